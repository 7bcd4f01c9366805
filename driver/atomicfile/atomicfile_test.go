package atomicfile

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

func TestWrite(t *testing.T) {
	cases := []struct {
		name string
		old  bool
		perm os.FileMode
		sync bool
	}{
		{name: "new file, synced", perm: 0o600, sync: true},
		{name: "replaces a file, not synced", old: true, perm: 0o644},
		{name: "replaces a file with another mode", old: true, perm: 0o755, sync: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "state.json")
			if tc.old {
				must.NoError(t, os.WriteFile(path, []byte("old content that is longer"), 0o600))
			}
			must.NoError(t, Write(path, []byte("new"), tc.perm, tc.sync))
			b, err := os.ReadFile(path)
			must.NoError(t, err)
			must.Eq(t, "new", string(b))
			fi, err := os.Stat(path)
			must.NoError(t, err)
			must.Eq(t, tc.perm, fi.Mode().Perm())
			assertOnly(t, dir, "state.json")
		})
	}
}

// A write that fails leaves the target as it was and no temporary file.
func TestWrite_FailureLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	// The rename fails: the target is a directory that is not empty.
	target := filepath.Join(dir, "target")
	must.NoError(t, os.MkdirAll(filepath.Join(target, "keep"), 0o700))
	err := Write(target, []byte("x"), 0o600, true)
	must.ErrorContains(t, err, `failed to rename into "`+target+`"`)
	assertOnly(t, dir, "target")

	// The directory is missing: nothing is made.
	err = Write(filepath.Join(dir, "missing", "f"), []byte("x"), 0o600, false)
	must.ErrorContains(t, err, "failed to write")
	assertOnly(t, dir, "target")
}

// assertOnly checks that dir holds exactly the named entries.
func assertOnly(t *testing.T, dir string, names ...string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	must.NoError(t, err)
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	must.Eq(t, names, got)
}
