package driver

import (
	"testing"

	"github.com/shoenig/test/must"
)

// taskGroup resolves a task's user to the group its volumes are made
// writable by, as the supervisor resolves the process's credentials.
// The cases use the users every Debian host has (root, nobody).
func TestTaskGroup(t *testing.T) {
	cases := []struct {
		user, want, err string
	}{
		{user: "", want: ""},
		{user: "root", want: ""},
		{user: "0", want: ""},
		{user: "nobody", want: "65534"},
		{user: "65534", want: "65534"},
		// A uid without a passwd entry: the gid of the same number.
		{user: "54321", want: "54321"},
		{user: "nobody:0", want: "0"},
		{user: "nobody:root", want: "0"},
		{user: "root:4242", want: "4242"},
		{user: "no-such-user-x", err: `user "no-such-user-x"`},
		{user: "nobody:no-such-group-x", err: `group "no-such-group-x"`},
		{user: "nobody:", err: "want name, uid, name:group or uid:gid"},
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
