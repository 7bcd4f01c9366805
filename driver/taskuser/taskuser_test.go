package taskuser

import (
	"testing"

	"github.com/shoenig/test/must"
)

// The cases use the users and groups every Debian host has (root, nobody,
// nogroup).
func TestResolve(t *testing.T) {
	cases := []struct {
		spec string
		uid  uint32
		gid  uint32
		err  string
	}{
		{spec: "", uid: 0, gid: 0},
		{spec: "root", uid: 0, gid: 0},
		{spec: "0", uid: 0, gid: 0},
		{spec: "nobody", uid: 65534, gid: 65534},
		{spec: "65534", uid: 65534, gid: 65534},
		// A uid without a passwd entry: the gid of the same number.
		{spec: "54321", uid: 54321, gid: 54321},
		{spec: "nobody:0", uid: 65534, gid: 0},
		{spec: "nobody:root", uid: 65534, gid: 0},
		{spec: "root:4242", uid: 0, gid: 4242},
		{spec: "no-such-user-x", err: `user "no-such-user-x" not found`},
		{spec: "nobody:no-such-group-x", err: `group "no-such-group-x" not found`},
		{spec: "nobody:", err: `invalid user "nobody:": want name, uid, name:group or uid:gid`},
		{spec: ":0", err: `invalid user ":0": want name, uid, name:group or uid:gid`},
	}
	for _, tc := range cases {
		t.Run(tc.spec, func(t *testing.T) {
			c, err := Resolve(tc.spec)
			if tc.err != "" {
				must.EqError(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.uid, c.UID)
			must.Eq(t, tc.gid, c.GID)
			must.SliceNotContains(t, c.Groups, c.GID, must.Sprint("the primary group is not repeated among the supplementary ones"))
		})
	}
}

func TestGroupID(t *testing.T) {
	for group, want := range map[string]uint32{"root": 0, "0": 0, "nogroup": 65534, "4242": 4242} {
		got, err := GroupID(group)
		must.NoError(t, err, must.Sprint(group))
		must.Eq(t, want, got, must.Sprint(group))
	}
	_, err := GroupID("no-such-group-x")
	must.ErrorContains(t, err, `group "no-such-group-x" not found`)
}
