package mounter

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

// CloneTreeBeneath on a real allocation's layout: Nomad's data_dir reached
// through a symlink (/var/lib/nomad -> /data/nomad, as operators move it),
// and the task's secrets/ a tmpfs of its own below the allocation's
// directory, with a submount. The trusted directory's own path may go
// through symlinks; crossing mount points below it is allowed (secrets/ and
// its token files are on the tmpfs), and a recursive clone brings the
// submount. What lies below it is never taken through a symlink: at the
// last element, in a directory on the way, or a source that is the
// directory itself or leaves it.
func TestMounter_CloneTreeBeneath_Root(t *testing.T) {
	requireRoot(t)
	m := New()
	base := privateDir(t)
	data := filepath.Join(base, "data", "nomad")
	must.NoError(t, os.MkdirAll(filepath.Join(data, "alloc", "a1"), 0o755))
	varLib := filepath.Join(base, "var", "lib")
	must.NoError(t, os.MkdirAll(varLib, 0o755))
	must.NoError(t, os.Symlink(data, filepath.Join(varLib, "nomad")))
	allocDir := filepath.Join(varLib, "nomad", "alloc", "a1")

	logs := filepath.Join(allocDir, "alloc", "logs")
	must.NoError(t, os.MkdirAll(logs, 0o777))
	must.NoError(t, os.WriteFile(filepath.Join(logs, "t.stdout.0"), []byte("log\n"), 0o644))
	secrets := filepath.Join(allocDir, "t", "secrets")
	mountTmpfs(t, secrets)
	token := filepath.Join(secrets, "nomad_token")
	must.NoError(t, os.WriteFile(token, []byte("token\n"), 0o600))
	mountTmpfs(t, filepath.Join(secrets, "sub"))
	must.NoError(t, os.WriteFile(filepath.Join(secrets, "sub", "f"), []byte("sub\n"), 0o600))

	// The host directory a symlink below the allocation's directory names.
	host := filepath.Join(base, "host")
	must.NoError(t, os.Mkdir(host, 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(host, "marker"), []byte("host\n"), 0o644))

	attach := func(t *testing.T, source string, isDir bool) string {
		t.Helper()
		tree, err := m.CloneTreeBeneath(allocDir, source, true)
		must.NoError(t, err)
		defer tree.Close()
		target := filepath.Join(base, "dst", filepath.Base(source))
		if isDir {
			must.NoError(t, os.MkdirAll(target, 0o755))
		} else {
			must.NoError(t, os.MkdirAll(filepath.Dir(target), 0o755))
			must.NoError(t, os.WriteFile(target, nil, 0o600))
		}
		cleanupMount(t, target)
		must.NoError(t, m.AttachTree(tree, target))
		return target
	}
	read := func(t *testing.T, path string) string {
		t.Helper()
		b, err := os.ReadFile(path)
		must.NoError(t, err)
		return string(b)
	}

	t.Run("through the data_dir symlink", func(t *testing.T) {
		dst := attach(t, logs, true)
		must.Eq(t, "log\n", read(t, filepath.Join(dst, "t.stdout.0")))
	})
	t.Run("across the secrets tmpfs, with its submount", func(t *testing.T) {
		dst := attach(t, secrets, true)
		must.Eq(t, "token\n", read(t, filepath.Join(dst, "nomad_token")))
		must.Eq(t, "sub\n", read(t, filepath.Join(dst, "sub", "f")))
		_, ok := mountAt(t, m, filepath.Join(dst, "sub"))
		must.True(t, ok, must.Sprint("the recursive clone left out the submount"))
	})
	t.Run("a token file on the tmpfs", func(t *testing.T) {
		dst := attach(t, token, false)
		must.Eq(t, "token\n", read(t, dst))
	})

	refused := func(t *testing.T, source, why string) {
		t.Helper()
		tree, err := m.CloneTreeBeneath(allocDir, source, true)
		if err == nil {
			_ = tree.Close()
		}
		must.Error(t, err, must.Sprintf("%s was cloned", source))
		must.StrContains(t, err.Error(), why)
	}
	t.Run("a symlink at the last element", func(t *testing.T) {
		link := filepath.Join(allocDir, "alloc", "planted")
		must.NoError(t, os.Symlink(host, link))
		defer os.Remove(link)
		refused(t, link, "symlink")
	})
	t.Run("a symlink on the way", func(t *testing.T) {
		link := filepath.Join(allocDir, "alloc", "via")
		must.NoError(t, os.Symlink(base, link))
		defer os.Remove(link)
		refused(t, filepath.Join(link, "host"), "symlink")
	})
	t.Run("the directory itself", func(t *testing.T) {
		refused(t, allocDir, "not below")
	})
	t.Run("out of the directory", func(t *testing.T) {
		refused(t, filepath.Join(allocDir, "..", "..", "..", "..", "..", "host"), "not below")
	})
}
