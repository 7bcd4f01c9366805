package wire

import (
	"fmt"
	"os"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

func TestParseStatStartTime(t *testing.T) {
	cases := []struct {
		stat string
		want uint64
		err  bool
	}{
		{"1 (init) S 0 1 1 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 42 1000 10", 42, false},
		{"7 (a b) c)) R 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99 1 1", 99, false},
		{"7 (short) R 1", 0, true},
		{"garbage", 0, true},
	}
	for _, tc := range cases {
		t.Run(tc.stat, func(t *testing.T) {
			got, err := ParseStatStartTime(tc.stat)
			if tc.err {
				must.Error(t, err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
	self, err := ProcStartTime(os.Getpid())
	must.NoError(t, err)
	must.Positive(t, self)
}

func TestParseCapabilities(t *testing.T) {
	cases := []struct {
		in   []string
		want []int
		err  string
	}{
		{[]string{"CAP_SYS_ADMIN", "sys_admin", "Net_Raw"}, []int{unix.CAP_SYS_ADMIN, unix.CAP_NET_RAW}, ""},
		{[]string{}, []int{}, ""},
		{[]string{"cap_bogus"}, nil, `unknown capability "cap_bogus"`},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.in), func(t *testing.T) {
			got, err := ParseCapabilities(tc.in)
			if tc.err != "" {
				must.EqError(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
	_, err := ParseCapabilities(DefaultCapabilities)
	must.NoError(t, err)
}

// A device node in an isolated task is read-only as a mount whatever was
// asked: it is the host's own inode. Anything else, and anything of a
// privileged task, is as asked.
func TestMountReadOnly(t *testing.T) {
	for _, tc := range []struct {
		name     string
		asked    bool
		isolated bool
		mode     uint32
		want     bool
	}{
		{"isolated char device", false, true, unix.S_IFCHR | 0o666, true},
		{"isolated block device", false, true, unix.S_IFBLK | 0o600, true},
		{"isolated dir", false, true, unix.S_IFDIR | 0o755, false},
		{"isolated file", false, true, unix.S_IFREG | 0o644, false},
		{"isolated fifo", false, true, unix.S_IFIFO | 0o644, false},
		{"isolated dir asked", true, true, unix.S_IFDIR, true},
		{"privileged block device", false, false, unix.S_IFBLK, false},
		{"privileged char device", false, false, unix.S_IFCHR, false},
		{"privileged block device asked", true, false, unix.S_IFBLK, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, MountReadOnly(tc.asked, tc.isolated, tc.mode))
		})
	}
}
