package driver

import (
	"testing"

	"github.com/shoenig/test/must"
)

// taskGroup is the primary group of the task's credential (resolved by
// taskuser.Resolve, whose own test covers the forms of user), or "" for a
// task that runs as root user and group.
func TestTaskGroup(t *testing.T) {
	cases := []struct {
		user, want, err string
	}{
		{user: "", want: ""},
		{user: "root", want: ""},
		{user: "nobody", want: "65534"},
		{user: "nobody:0", want: "0"},
		{user: "root:4242", want: "4242"},
		{user: "no-such-user-x", err: `user "no-such-user-x"`},
	}
	for _, tc := range cases {
		t.Run(tc.user, func(t *testing.T) {
			got, err := taskGroup(tc.user)
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
}
