package mounter

import (
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
)

// escapeField writes s as the kernel writes a mountinfo field, with the
// bytes that would end a field, an option or a line (and the backslash)
// as octal escapes.
func escapeField(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case ' ', '\t', '\n', '\r', '\\', ',':
			fmt.Fprintf(&b, `\%03o`, c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

func formatOptions(opts []string) string {
	out := make([]string, len(opts))
	for i, o := range opts {
		out[i] = escapeField(o)
	}
	return strings.Join(out, ",")
}

// formatMountInfo writes mp as one mountinfo line.
func formatMountInfo(mp MountPoint) string {
	fields := []string{
		fmt.Sprint(mp.ID), fmt.Sprint(mp.ParentID), fmt.Sprintf("%d:%d", mp.Major, mp.Minor),
		escapeField(mp.Root), escapeField(mp.Path), formatOptions(mp.Options),
	}
	if mp.Shared {
		fields = append(fields, fmt.Sprintf("shared:%d", mp.PeerGroup))
	}
	if mp.Slave {
		fields = append(fields, fmt.Sprintf("master:%d", mp.Master))
	}
	if mp.PropagateFrom != 0 {
		fields = append(fields, fmt.Sprintf("propagate_from:%d", mp.PropagateFrom))
	}
	if mp.Unbindable {
		fields = append(fields, "unbindable")
	}
	fields = append(fields, "-", escapeField(mp.FSType), escapeField(mp.Source), formatOptions(mp.SuperOptions))
	return strings.Join(fields, " ")
}

// FuzzParseMountInfo parses arbitrary text as mountinfo. It must not
// panic; an error names the line; what parses, written out again the way
// the kernel writes it, parses to the same mounts (so no field, option,
// escape or propagation tag is lost or made up), one per non-blank line.
func FuzzParseMountInfo(f *testing.F) {
	for _, s := range []string{
		"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n",
		"36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 shared:7 propagate_from:3 - ext3 /dev/root rw,errors=continue\n",
		"40 27 0:50 / /x rw unbindable future:9 - tmpfs tmpfs rw\n",
		`41 27 0:51 /a\040b /with\040space\011tab\012nl\134bs rw - fuse.sshfs user@host:/x\040y rw,user_id=0` + "\n",
		"42 27 0:52 / /x rw - tmpfs tmpfs rw,size=1k extra words\n\n   \n43 42 0:53 / /x/y ro,nosuid shared:1 - overlay overlay rw,lowerdir=/a:/b\n",
		"44 27 0:54 / /bad\\0 rw - tmpfs tmpfs\n",
		"x 27 0:54 / / rw - tmpfs tmpfs rw\n",
		"45 27 0:54 / / rw shared:x - tmpfs tmpfs rw\n",
		"46 27 054 / / rw - tmpfs tmpfs rw\n",
		"47 27 0:54 / / rw\n",
		"48 27 0:54 / / rw - - - -\n",
	} {
		f.Add(s)
	}
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		f.Add(string(b))
	}
	f.Fuzz(func(t *testing.T, text string) {
		mps, err := ParseMountInfo(strings.NewReader(text))
		if err != nil {
			if !strings.HasPrefix(err.Error(), "failed to parse mountinfo line ") && !strings.HasPrefix(err.Error(), "failed to read mountinfo: ") {
				t.Fatalf("error %q does not say which line", err)
			}
			return
		}
		lines := 0
		for _, l := range strings.Split(text, "\n") {
			if strings.TrimSpace(l) != "" {
				lines++
			}
		}
		if len(mps) != lines {
			t.Fatalf("%d mounts from %d non-blank lines", len(mps), lines)
		}
		var out strings.Builder
		for _, mp := range mps {
			out.WriteString(formatMountInfo(mp) + "\n")
		}
		again, err := ParseMountInfo(strings.NewReader(out.String()))
		if err != nil {
			t.Fatalf("written out again, %q does not parse: %v", out.String(), err)
		}
		if !reflect.DeepEqual(mps, again) {
			t.Fatalf("written out again as %q, parsed to\n%+v\nnot\n%+v", out.String(), again, mps)
		}
	})
}

// kernelEscape escapes s as the kernel escapes a mountinfo path, type or
// source (and, with ",", an option's value): space, tab, newline and
// backslash as octal, nothing else.
func kernelEscape(s, more string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; strings.IndexByte(" \t\n\\"+more, c) >= 0 {
			fmt.Fprintf(&b, `\%03o`, c)
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}

// FuzzMountInfoLine writes a mount as the kernel would, from arbitrary
// paths, type, source and super options, and parses it: the mount must
// come back as written.
func FuzzMountInfoLine(f *testing.F) {
	f.Add("/", "/mnt/with space", "ext4", "/dev/vda", "rw,lowerdir=/a\\b", true, 7, false, 0)
	f.Add("/sub\tdir", "/x\ny", "fuse.sshfs", "user@host:/x", "rw,user_id=0", false, 0, true, 3)
	f.Add("/", "/x", "tmpfs", "tmpfs", "rw,size=1k,path=/a\r", false, 0, false, 0)
	f.Fuzz(func(t *testing.T, root, path, fstype, source, superOpts string, shared bool, peer int, slave bool, master int) {
		var super []string
		if superOpts != "" {
			super = strings.Split(superOpts, ",")
		}
		want := MountPoint{ID: 40, ParentID: 27, Major: 0, Minor: 50, Root: root, Path: path, FSType: fstype, Source: source,
			Options: []string{"rw", "nosuid"}, SuperOptions: super,
			Shared: shared, PeerGroup: max(peer, 0) * btoi(shared), Slave: slave, Master: max(master, 0) * btoi(slave)}
		opts := make([]string, len(super))
		for i, o := range super {
			opts[i] = kernelEscape(o, ",")
		}
		line := fmt.Sprintf("40 27 0:50 %s %s rw,nosuid", kernelEscape(root, ""), kernelEscape(path, ""))
		if want.Shared {
			line += fmt.Sprintf(" shared:%d", want.PeerGroup)
		}
		if want.Slave {
			line += fmt.Sprintf(" master:%d", want.Master)
		}
		line += fmt.Sprintf(" - %s %s %s\n", kernelEscape(fstype, ""), kernelEscape(source, ""), strings.Join(opts, ","))
		mps, err := ParseMountInfo(strings.NewReader(line))
		if err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		if len(mps) != 1 || !reflect.DeepEqual(want, mps[0]) {
			t.Fatalf("%q parsed to\n%+v\nnot\n%+v", line, mps, want)
		}
	})
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
