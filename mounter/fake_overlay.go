package mounter

import (
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ActionMountOverlay is the kind of FakeAction that MountOverlay records:
// Source is the lower layers joined by ':' (lowest first), Data the upper
// and work directories joined by ':'.
const ActionMountOverlay = "overlay"

// MountOverlay records an ActionMountOverlay and adds an overlay mount at
// target, unless MountErrs fails target. It checks o as the real one does.
func (f *Fake) MountOverlay(target string, o Overlay) error {
	if err := checkOverlay(o); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var flags uintptr
	if o.NoSuid {
		flags |= unix.MS_NOSUID
	}
	if o.NoDev {
		flags |= unix.MS_NODEV
	}
	f.record(FakeAction{Kind: ActionMountOverlay, Source: strings.Join(o.Lower, ":"), Target: target, FSType: "overlay",
		Flags: flags, Data: o.Upper + ":" + o.Work})
	if err := f.MountErrs[target]; err != nil {
		return err
	}
	f.add(MountPoint{Root: "/", Path: filepath.Clean(target), FSType: "overlay", Source: "overlay", Options: []string{"rw"}})
	return nil
}
