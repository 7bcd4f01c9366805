package executor

import (
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// A repaired volume gets the flags its first mount had: an isolated task's
// block-device volume stays openable (dev), everything else of an isolated
// task is nosuid and nodev, and a privileged task's keeps what its spec
// says.
func TestReplaceFlags(t *testing.T) {
	for _, tc := range []struct {
		name                string
		mnt                 Mount
		isolated            bool
		mode                uint32
		wantNoSuid, wantDev bool
	}{
		{"isolated dir", Mount{}, true, unix.S_IFDIR, true, false},
		{"isolated file", Mount{}, true, unix.S_IFREG, true, false},
		{"isolated block device", Mount{}, true, unix.S_IFBLK | 0o600, true, true},
		{"isolated char device", Mount{}, true, unix.S_IFCHR, true, false},
		{"privileged dir", Mount{}, false, unix.S_IFDIR, false, true},
		{"privileged block device", Mount{}, false, unix.S_IFBLK, false, true},
		{"spec nodev kept", Mount{NoSuid: true, NoDev: true}, false, unix.S_IFBLK, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noSuid, noDev := replaceFlags(tc.mnt, tc.isolated, tc.mode)
			must.Eq(t, tc.wantNoSuid, noSuid)
			must.Eq(t, tc.wantDev, !noDev)
		})
	}
}
