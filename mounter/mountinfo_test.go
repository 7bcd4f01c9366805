package mounter

import (
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

func TestParseMountInfo(t *testing.T) {
	cases := []struct {
		name  string
		input string
		want  []MountPoint
		err   string
	}{
		{
			name:  "private root",
			input: "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n",
			want: []MountPoint{{
				ID: 27, ParentID: 1, Major: 254, Minor: 0, Root: "/", Path: "/", FSType: "ext4", Source: "/dev/vda",
				Options: []string{"rw", "relatime"}, SuperOptions: []string{"rw", "discard"},
			}},
		},
		{
			name:  "shared and slave with propagate_from",
			input: "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 shared:7 propagate_from:3 - ext3 /dev/root rw,errors=continue\n",
			want: []MountPoint{{
				ID: 36, ParentID: 35, Major: 98, Root: "/mnt1", Path: "/mnt2", FSType: "ext3", Source: "/dev/root",
				Options: []string{"rw", "noatime"}, SuperOptions: []string{"rw", "errors=continue"},
				Shared: true, PeerGroup: 7, Slave: true, Master: 1, PropagateFrom: 3,
			}},
		},
		{
			name:  "unbindable and unknown optional field",
			input: "40 27 0:50 / /x rw unbindable future:9 - tmpfs tmpfs rw\n",
			want: []MountPoint{{
				ID: 40, ParentID: 27, Minor: 50, Root: "/", Path: "/x", FSType: "tmpfs", Source: "tmpfs",
				Options: []string{"rw"}, SuperOptions: []string{"rw"}, Unbindable: true,
			}},
		},
		{
			name:  "escaped space tab newline backslash",
			input: `41 27 0:51 /a\040b /mnt/with\040space\011tab\012nl\134bs rw shared:12 - fuse.sshfs user@host:/my\040dir rw,user_id=0` + "\n",
			want: []MountPoint{{
				ID: 41, ParentID: 27, Minor: 51, Root: "/a b", Path: "/mnt/with space\ttab\nnl\\bs",
				FSType: "fuse.sshfs", Source: "user@host:/my dir", Options: []string{"rw"},
				SuperOptions: []string{"rw", "user_id=0"}, Shared: true, PeerGroup: 12,
			}},
		},
		{
			name:  "backslash not followed by octal is kept",
			input: `42 27 0:52 / /odd\9x rw - tmpfs tmpfs rw` + "\n",
			want: []MountPoint{{
				ID: 42, ParentID: 27, Minor: 52, Root: "/", Path: `/odd\9x`, FSType: "tmpfs", Source: "tmpfs",
				Options: []string{"rw"}, SuperOptions: []string{"rw"},
			}},
		},
		{
			name:  "empty superoptions and blank lines",
			input: "\n43 27 0:53 / /e rw - proc proc \n\n",
			want: []MountPoint{{
				ID: 43, ParentID: 27, Minor: 53, Root: "/", Path: "/e", FSType: "proc", Source: "proc",
				Options: []string{"rw"},
			}},
		},
		{name: "empty", input: "", want: nil},
		{name: "no separator", input: "1 2 0:1 / / rw shared:1 ext4 /dev/x rw\n", err: "separator"},
		{name: "bad id", input: "x 2 0:1 / / rw - ext4 /dev/x rw\n", err: "bad mount id"},
		{name: "bad device", input: "1 2 01 / / rw - ext4 /dev/x rw\n", err: "bad device"},
		{name: "bad peer group", input: "1 2 0:1 / / rw shared:x - ext4 /dev/x rw\n", err: "bad optional field"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseMountInfo(strings.NewReader(tc.input))
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
}

func TestMountPoint_Propagation(t *testing.T) {
	cases := []struct {
		mp   MountPoint
		want string
	}{
		{MountPoint{}, "private"},
		{MountPoint{Shared: true}, "shared"},
		{MountPoint{Slave: true}, "slave"},
		{MountPoint{Shared: true, Slave: true}, "shared,slave"},
		{MountPoint{Unbindable: true}, "unbindable"},
	}
	for _, tc := range cases {
		must.Eq(t, tc.want, tc.mp.Propagation())
	}
}

func TestFindMount(t *testing.T) {
	mounts := []MountPoint{
		{ID: 1, Path: "/"},
		{ID: 2, Path: "/var"},
		{ID: 3, Path: "/var/lib"},
		{ID: 4, Path: "/var/lib"}, // stacked on top of 3
		{ID: 5, Path: "/var/library"},
	}
	cases := []struct {
		path string
		want int
	}{
		{"/", 1},
		{"/etc", 1},
		{"/var", 2},
		{"/var/lib", 4},
		{"/var/lib/x/y", 4},
		{"/var/libx", 2},
		{"/var/library/a", 5},
	}
	for _, tc := range cases {
		t.Run(tc.path, func(t *testing.T) {
			got, ok := FindMount(mounts, tc.path)
			must.True(t, ok)
			must.Eq(t, tc.want, got.ID)
		})
	}
	_, ok := FindMount(nil, "/x")
	must.False(t, ok)
}

func TestSanitizeOptions(t *testing.T) {
	must.Eq(t, "ro,vers=4,<masked>,<masked>", SanitizeOptions([]string{"ro", "vers=4"}, []string{"password=hunter2", "token=x"}))
	must.Eq(t, "", SanitizeOptions(nil, nil))
}
