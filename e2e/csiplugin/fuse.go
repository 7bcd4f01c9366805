package main

// "fuse" volumes are directories under --state-dir (like "dir" volumes)
// that NodeStageVolume serves at the staging path through a FUSE loopback
// file system run by this process (github.com/hanwen/go-fuse/v2), and
// NodePublishVolume binds from there, as FUSE-backed CSI plugins (s3, gcs)
// do. Killing the fixture leaves every such mount dead (ENOTCONN) while
// the data stays in the backing directory: a new fixture serves the same
// files once the volume is unstaged and staged again.

import (
	"fmt"
	"path/filepath"
	"sync"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

const (
	typeFuse = "fuse"
	// fuseName is the FUSE subtype: mounts show as "fuse.csi-fixture".
	fuseName = "csi-fixture"
)

// dirLike reports whether volumes of typ are directories of their own
// (no image, no block access, no filesystem mount options).
func dirLike(typ string) bool { return typ == typeDir || typ == typeFuse }

// fuseServers are the FUSE servers this process runs, by staging path.
var fuseServers = struct {
	sync.Mutex
	m map[string]*fuse.Server
}{m: map[string]*fuse.Server{}}

// fuseSource is the mount source of a fuse volume's mounts, by which the
// fixture knows its own mounts whether their server is alive or dead.
func fuseSource(v *volume) string { return fuseName + ":" + v.ID }

// fuseHolds reports whether path is a mount (alive or dead) of v's FUSE
// file system, or a bind of one.
func fuseHolds(v *volume, path string) bool {
	table, err := mounter.New().List()
	if err != nil {
		return false
	}
	mp, ok := mounter.FindMount(table, filepath.Clean(path))
	return ok && mp.Path == filepath.Clean(path) && mp.Source == fuseSource(v)
}

// fuseLive reports whether this process serves the FUSE mount at stg.
func fuseLive(stg string) bool {
	fuseServers.Lock()
	defer fuseServers.Unlock()
	return fuseServers.m[filepath.Clean(stg)] != nil
}

// fuseStage serves v's directory at stg. bits are the MS_* flags asked for
// (only read-only matters: the kernel makes FUSE mounts nosuid and nodev
// for us as we ask).
func (p *plugin) fuseStage(v *volume, stg string, readOnly bool) error {
	root, err := fusefs.NewLoopbackRoot(p.store.dataPath(v))
	if err != nil {
		return err
	}
	opts := []string{"default_permissions"}
	if readOnly {
		opts = append(opts, "ro")
	}
	srv, err := fusefs.Mount(stg, root, &fusefs.Options{MountOptions: fuse.MountOptions{
		// Tasks run as any user: the kernel checks the files' modes.
		AllowOther:        true,
		DirectMountStrict: true,
		FsName:            fuseSource(v),
		Name:              fuseName,
		Options:           opts,
	}})
	if err != nil {
		return fmt.Errorf("failed to serve volume %q through FUSE at %q: %w", v.ID, stg, err)
	}
	fuseServers.Lock()
	fuseServers.m[filepath.Clean(stg)] = srv
	fuseServers.Unlock()
	return nil
}

// fuseUnstage unmounts a fuse volume's staging mount, alive or dead, and
// lets its server (if this process runs it) end.
func fuseUnstage(stg string) error {
	stg = filepath.Clean(stg)
	if err := unmountAll(stg); err != nil {
		return err
	}
	fuseServers.Lock()
	srv := fuseServers.m[stg]
	delete(fuseServers.m, stg)
	fuseServers.Unlock()
	if srv != nil {
		srv.Wait()
	}
	return nil
}

// fuseBits is what a fuse volume's read-only flag is in MS_* bits.
func fuseReadOnly(bits uintptr) bool { return bits&syscall.MS_RDONLY != 0 }
