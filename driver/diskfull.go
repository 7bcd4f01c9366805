package driver

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// A full root_dir is not a broken driver.
//
// root_dir often shares its file system with Nomad's data_dir, where every
// task's /local and /alloc/data are: a task (a hostile one, or a log gone
// wild) can take every inode or block of it. Nomad does not enforce
// ephemeral_disk. What runs must then go on: each task's exit status has
// its file from the start (wire.ReserveExit), volume teardowns append to a
// journal that exists, and the driver stays healthy, for the node is not
// taken out of the cluster by one tenant's files. What cannot work is a new
// task: its state (a directory and a few small files) needs inodes and
// blocks. A start is refused at once, naming the file system and the fix,
// before any volume is staged for it, and the health check says the same
// in the node's driver status (still healthy); Nomad places the allocation
// again, preferring another node. A root_dir that cannot be written for
// any other reason (read-only, gone, permission) is broken: unhealthy.

// Below these, root_dir's file system counts as full: a task's start
// makes a handful of files and directories of a few KiB.
const (
	minFreeInodes = 64
	minFreeBytes  = 4 << 20
)

// fullError says that root_dir's file system is full.
type fullError struct {
	rootDir string
	// fs describes the file system: "ext4 /dev/vda1 mounted at /".
	fs string
	// what is full: "inodes", "space" or "quota".
	what string
	err  error
}

func (e *fullError) Error() string {
	var full string
	switch e.what {
	case "inodes":
		full = "has no free inodes left"
	case "quota":
		full = "is over its disk quota"
	default:
		full = "has no free space left"
	}
	return fmt.Sprintf("the file system of root_dir %q (%s) %s: running tasks keep running and report their exit, "+
		"but no new task can start on this node until files are removed there; keep root_dir on a file system "+
		"of its own, apart from Nomad's data_dir", e.rootDir, e.fs, full)
}

func (e *fullError) Unwrap() error { return e.err }

// isFullErrno tells the errors of a full file system (no inode, no block,
// quota) from every other.
func isFullErrno(err error) bool {
	return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)
}

// statfsRoom says whether the file system of dir, as statfs sees it, is
// full for root (root may use the blocks reserved for it): "inodes",
// "space", or "" when there is room. A file system that counts no inodes
// (btrfs) is never full of them.
func statfsRoom(st *unix.Statfs_t) string {
	switch {
	case st.Files > 0 && st.Ffree < minFreeInodes:
		return "inodes"
	case st.Blocks > 0 && st.Bfree*uint64(st.Bsize) < minFreeBytes:
		return "space"
	}
	return ""
}

// rootRoom checks that root_dir's file system has room for a task's state:
// nil, a *fullError, or the error of the check itself (which says nothing
// about room). cause is the error a write there failed with, if any.
func (d *Driver) rootRoom(conf *Config, cause error) error {
	dir := conf.tasksDir()
	what := ""
	switch {
	case errors.Is(cause, unix.EDQUOT):
		what = "quota"
	case cause != nil && !isFullErrno(cause):
		return cause
	}
	var st unix.Statfs_t
	if err := d.host.Statfs(dir, &st); err != nil {
		if cause != nil {
			return &fullError{rootDir: conf.RootDir, fs: d.describeFS(dir), what: "space", err: cause}
		}
		return fmt.Errorf("failed to check the room left in root_dir %q: %w", conf.RootDir, err)
	}
	if what == "" {
		what = statfsRoom(&st)
	}
	if what == "" && cause != nil {
		// ENOSPC with room by statfs: blocks reserved for metadata, or
		// taken since.
		what = "space"
	}
	if what == "" {
		return nil
	}
	if cause == nil {
		cause = unix.ENOSPC
	}
	return &fullError{rootDir: conf.RootDir, fs: d.describeFS(dir), what: what, err: cause}
}

// describeFS names the file system dir is on, for an operator.
func (d *Driver) describeFS(dir string) string {
	mounts, err := d.mounter.List()
	if err != nil {
		return "file system unknown: " + err.Error()
	}
	mp, ok := mounter.FindMount(mounts, dir)
	if !ok {
		return "file system unknown"
	}
	return fmt.Sprintf("%s %s mounted at %s", mp.FSType, mp.Source, mp.Path)
}
