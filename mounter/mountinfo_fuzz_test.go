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
		for _, l := range strings.Split(strings.ReplaceAll(text, "\r\n", "\n"), "\n") {
			if strings.TrimSpace(strings.TrimSuffix(l, "\r")) != "" {
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
