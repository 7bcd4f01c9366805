package wire

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

func exitStatus() *ExitStatus {
	return &ExitStatus{ExitCode: 3, Signal: 0, PidsLimited: 2, ExitedAt: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)}
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	must.NoError(t, err)
	return fi.Sys().(*syscall.Stat_t).Ino
}

// A reserved file reads as no status; the status is written into that very
// file (same inode, same size) and read back.
func TestExit_reservedWrittenInPlace(t *testing.T) {
	path := filepath.Join(t.TempDir(), ExitFile)
	must.NoError(t, ReserveExit(path))
	_, err := ReadExit(path)
	must.ErrorIs(t, err, fs.ErrNotExist)
	ino := inode(t, path)

	want := exitStatus()
	must.NoError(t, WriteExit(path, want))
	must.Eq(t, ino, inode(t, path), must.Sprint("the status was not written in place"))
	fi, err := os.Stat(path)
	must.NoError(t, err)
	must.Eq(t, int64(ExitSlotSize), fi.Size())
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	got, err := ReadExit(path)
	must.NoError(t, err)
	must.Eq(t, want, got)
	// No temporary file was made beside it.
	entries, err := os.ReadDir(filepath.Dir(path))
	must.NoError(t, err)
	must.SliceLen(t, 1, entries)
}

// A state directory without a reserved file (a supervisor handed one by
// hand) gets the status the old way; a status an older supervisor wrote
// (plain JSON, renamed into place) is read as before.
func TestExit_unreservedAndOlderFormat(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, ExitFile)
	want := exitStatus()
	must.NoError(t, WriteExit(path, want))
	got, err := ReadExit(path)
	must.NoError(t, err)
	must.Eq(t, want, got)

	must.NoError(t, WriteJSONAtomic(path, want, 0o600))
	got, err = ReadExit(path)
	must.NoError(t, err)
	must.Eq(t, want, got)

	// A torn write (a crash of the host) is an error, never a status.
	must.NoError(t, os.WriteFile(path, []byte(`{"exit_code":0,"sig`+strings.Repeat("\x00", 100)), 0o600))
	_, err = ReadExit(path)
	must.ErrorContains(t, err, "failed to decode")
	must.NoError(t, os.WriteFile(path, make([]byte, ExitSlotSize), 0o600))
	_, err = ReadExit(path)
	must.ErrorIs(t, err, fs.ErrNotExist)

	_, err = ReadExit(filepath.Join(dir, "missing"))
	must.ErrorIs(t, err, fs.ErrNotExist)
}

// A long message is cut so that the status fits one sector, whatever JSON
// makes of its bytes.
func TestExit_longErrFitsOneSector(t *testing.T) {
	for _, msg := range []string{
		strings.Repeat("x", 5000),
		strings.Repeat("é", 3000),
		strings.Repeat("\x1b", 2000),
		strings.Repeat("<\u2028>", 700),
		strings.Repeat("a", ExitRecordMax-200),
	} {
		st := exitStatus()
		st.Err = msg
		b, err := encodeExit(st)
		must.NoError(t, err)
		must.LessEq(t, ExitRecordMax, len(b))
		var back ExitStatus
		must.NoError(t, json.Unmarshal(b, &back))
		if len(msg) > ExitRecordMax {
			must.StrHasSuffix(t, " (cut)", back.Err)
			kept := strings.TrimSuffix(back.Err, " (cut)")
			must.StrHasPrefix(t, kept, msg)
			// As much as fits: one more rune would not.
			more := *st
			more.Err = msg[:len(kept)+len(string([]rune(msg[len(kept):])[:1]))] + " (cut)"
			longer, err := encodeLine(&more)
			must.NoError(t, err)
			must.Greater(t, ExitRecordMax, len(longer))
		} else {
			must.Eq(t, msg, back.Err)
		}
		must.Eq(t, st.ExitCode, back.ExitCode)
	}
}

// The point of the reservation: on a file system whose inodes and blocks
// are all taken (a task filled it), the status is still recorded, where
// the old way (a temporary file renamed into place) fails.
func TestExit_fullFileSystem_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts small file systems")
	}
	for _, fsType := range []string{"tmpfs", "ext4"} {
		t.Run(fsType, func(t *testing.T) {
			dir := smallFS(t, fsType)
			path := filepath.Join(dir, ExitFile)
			must.NoError(t, ReserveExit(path))
			fillFS(t, dir)

			// Nothing new fits: the old way fails.
			err := WriteJSONAtomic(filepath.Join(dir, "other.json"), exitStatus(), 0o600)
			must.Error(t, err)
			must.True(t, errors.Is(err, unix.ENOSPC), must.Sprintf("want ENOSPC: %v", err))

			want := exitStatus()
			want.Err = strings.Repeat("m", 1000)
			must.NoError(t, WriteExit(path, want))
			got, err := ReadExit(path)
			must.NoError(t, err)
			must.Eq(t, 3, got.ExitCode)
			must.StrHasSuffix(t, " (cut)", got.Err)
		})
	}
}

// smallFS mounts a file system of a few hundred KiB and few inodes on a
// new directory, unmounted when the test ends.
func smallFS(t *testing.T, fsType string) string {
	t.Helper()
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	must.NoError(t, os.Mkdir(mnt, 0o700))
	switch fsType {
	case "tmpfs":
		must.NoError(t, unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=256k,nr_inodes=16,mode=0700"))
	case "ext4":
		if _, err := exec.LookPath("mkfs.ext4"); err != nil {
			t.Skip("no mkfs.ext4")
		}
		img := filepath.Join(dir, "fs.img")
		must.NoError(t, os.WriteFile(img, nil, 0o600))
		must.NoError(t, os.Truncate(img, 2<<20))
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-N", "32", "-m", "0", img).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.ext4: %v: %s", err, out)
		}
		if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
			t.Fatalf("mount: %v: %s", err, out)
		}
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
	})
	return mnt
}

// fillFS takes every inode, then every block, of dir's file system.
func fillFS(t *testing.T, dir string) {
	t.Helper()
	var last string
	for i := 0; ; i++ {
		p := filepath.Join(dir, fmt.Sprintf("f%d", i))
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, unix.ENOSPC) {
			break
		}
		must.NoError(t, err)
		_ = f.Close()
		last = p
	}
	must.NotEq(t, "", last, must.Sprint("no file could be made at all"))
	f, err := os.OpenFile(last, os.O_WRONLY, 0)
	must.NoError(t, err)
	defer f.Close()
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); err != nil {
			must.True(t, errors.Is(err, unix.ENOSPC), must.Sprintf("want ENOSPC: %v", err))
			break
		}
	}
	var st unix.Statfs_t
	must.NoError(t, unix.Statfs(dir, &st))
	t.Logf("full: %d of %d inodes free, %d of %d blocks free", st.Ffree, st.Files, st.Bfree, st.Blocks)
}

// BenchmarkExitFile is what the reserved exit status costs beside what it
// replaced: "reserve" is the extra file every start now makes (unsynced),
// "spec" the spec file every start already wrote, for scale, each a new
// file as at a start; "in_place" and "renamed" are the supervisor's synced
// write of the status now and before.
func BenchmarkExitFile(b *testing.B) {
	dir := b.TempDir()
	st := exitStatus()
	spec := Spec{TaskID: "a/b/c", StateDir: dir, Command: "/bin/sh", Args: []string{"-c", "true"},
		Env: []string{"PATH=/usr/bin:/bin", "A=1"}, Mounts: make([]Mount, 8)}
	b.Run("reserve", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := ReserveExit(filepath.Join(dir, fmt.Sprintf("exit-%d", i))); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("spec", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := WriteJSON(filepath.Join(dir, fmt.Sprintf("spec-%d", i)), &spec, 0o600, false); err != nil {
				b.Fatal(err)
			}
		}
	})
	path := filepath.Join(dir, ExitFile)
	b.Run("in_place", func(b *testing.B) {
		if err := ReserveExit(path); err != nil {
			b.Fatal(err)
		}
		for i := 0; i < b.N; i++ {
			if err := WriteExit(path, st); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("renamed", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := WriteJSONAtomic(filepath.Join(dir, "old.json"), st, 0o600); err != nil {
				b.Fatal(err)
			}
		}
	})
}
