package driver

import (
	"os"
	"path/filepath"
	"testing"
	"testing/fstest"

	"github.com/shoenig/test/must"
)

func TestInstallShim(t *testing.T) {
	root := t.TempDir()

	// No shim in the build: the executor uses the driver's own binary.
	path, err := installShim(fstest.MapFS{"shimbin/README.md": {Data: []byte("x")}}, root)
	must.NoError(t, err)
	must.Eq(t, "", path)

	files := fstest.MapFS{"shimbin/" + shimName: {Data: []byte("shim v1")}}
	path, err = installShim(files, root)
	must.NoError(t, err)
	must.StrHasPrefix(t, filepath.Join(root, "bin", shimName+"-"), path)
	data, err := os.ReadFile(path)
	must.NoError(t, err)
	must.Eq(t, "shim v1", string(data))
	fi, err := os.Stat(path)
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o755), fi.Mode().Perm())

	// Installing the same shim again keeps it; a new one replaces it.
	again, err := installShim(files, root)
	must.NoError(t, err)
	must.Eq(t, path, again)
	newer, err := installShim(fstest.MapFS{"shimbin/" + shimName: {Data: []byte("shim v2")}}, root)
	must.NoError(t, err)
	must.NotEq(t, path, newer)
	_, err = os.Stat(path)
	must.True(t, os.IsNotExist(err))
	entries, err := os.ReadDir(filepath.Join(root, "bin"))
	must.NoError(t, err)
	must.Len(t, 1, entries)
}
