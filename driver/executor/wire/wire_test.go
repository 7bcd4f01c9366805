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
