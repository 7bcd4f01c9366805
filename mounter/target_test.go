package mounter

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

func TestOpenTarget(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	must.NoError(t, os.MkdirAll(filepath.Join(root, "a/b"), 0o755))
	must.NoError(t, os.Symlink(outside, filepath.Join(root, "a/link")))
	must.NoError(t, os.Symlink("../..", filepath.Join(root, "a/up")))
	must.NoError(t, os.WriteFile(filepath.Join(root, "a/file"), nil, 0o644))
	m := New()

	t.Run("missing directories are made below root", func(t *testing.T) {
		f, err := m.OpenTarget(root, "/a/b/c/d", true)
		must.NoError(t, err)
		must.NoError(t, f.Close())
		fi, err := os.Lstat(filepath.Join(root, "a/b/c/d"))
		must.NoError(t, err)
		must.True(t, fi.IsDir())
	})
	t.Run("a missing file is made empty", func(t *testing.T) {
		f, err := m.OpenTarget(root, "/a/new/file", false)
		must.NoError(t, err)
		must.Eq(t, filepath.Join(root, "a/new/file"), f.Name())
		must.NoError(t, f.Close())
		fi, err := os.Lstat(filepath.Join(root, "a/new/file"))
		must.NoError(t, err)
		must.True(t, fi.Mode().IsRegular())
	})
	for _, path := range []string{"/a/link/escape", "/a/link", "/a/up/escape"} {
		t.Run("symlink refused "+path, func(t *testing.T) {
			_, err := m.OpenTarget(root, path, true)
			must.Error(t, err)
			must.True(t, errors.Is(err, ErrSymlinkTarget))
			entries, err := os.ReadDir(outside)
			must.NoError(t, err)
			must.SliceEmpty(t, entries)
			_, err = os.Lstat(filepath.Join(filepath.Dir(root), "escape"))
			must.True(t, errors.Is(err, os.ErrNotExist))
		})
	}
	t.Run("type mismatch", func(t *testing.T) {
		_, err := m.OpenTarget(root, "/a/file", true)
		must.ErrorContains(t, err, "not a directory")
		_, err = m.OpenTarget(root, "/a/b", false)
		must.ErrorContains(t, err, "want a file")
		_, err = m.OpenTarget(root, "/a/file/x", true)
		must.ErrorContains(t, err, "not a directory")
	})
}
