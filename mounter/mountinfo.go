package mounter

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// MountPoint is one line of /proc/PID/mountinfo (see proc(5)).
type MountPoint struct {
	// ID and ParentID are the mount's unique ID and its parent's.
	ID, ParentID int
	// Major and Minor are the st_dev of files on this filesystem.
	Major, Minor int
	// Root is the path of the directory of the filesystem that forms the
	// root of this mount (not "/" for bind mounts of a subdirectory).
	Root string
	// Path is the mount point, relative to the process's root.
	Path string
	// FSType is the filesystem type, with any subtype ("fuse.sshfs").
	FSType string
	// Source is the filesystem-specific source ("/dev/vda", "tmpfs").
	Source string
	// Options are the per-mount options ("rw", "nosuid", "relatime").
	Options []string
	// SuperOptions are the per-superblock options.
	SuperOptions []string

	// Shared is set when the mount is in peer group PeerGroup.
	Shared    bool
	PeerGroup int
	// Slave is set when the mount receives propagation from peer group
	// Master.
	Slave  bool
	Master int
	// PropagateFrom is the nearest dominant peer group a slave receives
	// from, when it is not visible in this namespace (0 when absent).
	PropagateFrom int
	// Unbindable is set for mounts that cannot be bind-mounted.
	Unbindable bool
}

// Propagation returns the mount's propagation type in mount(8)'s
// spelling: "shared", "slave", "shared,slave" (both), "unbindable" or
// "private".
func (m MountPoint) Propagation() string {
	switch {
	case m.Shared && m.Slave:
		return "shared,slave"
	case m.Shared:
		return PropagationShared
	case m.Slave:
		return PropagationSlave
	case m.Unbindable:
		return "unbindable"
	default:
		return PropagationPrivate
	}
}

// ParseMountInfo parses the contents of a mountinfo file. Paths are
// unescaped (the kernel writes space, tab, newline and backslash as \040,
// \011, \012 and \134).
func ParseMountInfo(r io.Reader) ([]MountPoint, error) {
	var out []MountPoint
	if err := eachMountInfo(r, func(mp MountPoint) { out = append(out, mp) }); err != nil {
		return nil, err
	}
	return out, nil
}

// eachMountInfo parses a mountinfo file a line at a time, calling fn with
// each mount, so that a caller that keeps only some holds no more.
func eachMountInfo(r io.Reader, fn func(MountPoint)) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	sc.Split(scanLines)
	lineNo := 0
	for sc.Scan() {
		lineNo++
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			continue
		}
		mp, err := parseMountInfoLine(line)
		if err != nil {
			return fmt.Errorf("failed to parse mountinfo line %d %q: %w", lineNo, line, err)
		}
		fn(mp)
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("failed to read mountinfo: %w", err)
	}
	return nil
}

// scanLines splits at '\n' only: unlike bufio.ScanLines it keeps a '\r'
// before it, which the kernel does not escape in super options (an
// overlay's lowerdir= a directory whose name ends in '\r').
func scanLines(data []byte, atEOF bool) (advance int, token []byte, err error) {
	if i := bytes.IndexByte(data, '\n'); i >= 0 {
		return i + 1, data[:i], nil
	}
	if atEOF && len(data) > 0 {
		return len(data), data, nil
	}
	return 0, nil, nil
}

func parseMountInfoLine(line string) (MountPoint, error) {
	var mp MountPoint
	fields := strings.Split(line, " ")
	// Six fixed fields, zero or more optional fields, "-", then three.
	sep := -1
	for i := 6; i < len(fields); i++ {
		if fields[i] == "-" {
			sep = i
			break
		}
	}
	if len(fields) < 10 || sep < 0 || len(fields) < sep+4 {
		return mp, fmt.Errorf("expected at least 10 fields with a \"-\" separator, got %d", len(fields))
	}

	var err error
	if mp.ID, err = strconv.Atoi(fields[0]); err != nil {
		return mp, fmt.Errorf("bad mount id %q: %w", fields[0], err)
	}
	if mp.ParentID, err = strconv.Atoi(fields[1]); err != nil {
		return mp, fmt.Errorf("bad parent id %q: %w", fields[1], err)
	}
	major, minor, ok := strings.Cut(fields[2], ":")
	if !ok {
		return mp, fmt.Errorf("bad device %q: want major:minor", fields[2])
	}
	if mp.Major, err = strconv.Atoi(major); err != nil {
		return mp, fmt.Errorf("bad device major %q: %w", fields[2], err)
	}
	if mp.Minor, err = strconv.Atoi(minor); err != nil {
		return mp, fmt.Errorf("bad device minor %q: %w", fields[2], err)
	}
	mp.Root = unescape(fields[3])
	mp.Path = unescape(fields[4])
	mp.Options = splitOptions(fields[5])

	for _, opt := range fields[6:sep] {
		tag, val, _ := strings.Cut(opt, ":")
		switch tag {
		case "shared":
			mp.Shared = true
			if mp.PeerGroup, err = strconv.Atoi(val); err != nil {
				return mp, fmt.Errorf("bad optional field %q: %w", opt, err)
			}
		case "master":
			mp.Slave = true
			if mp.Master, err = strconv.Atoi(val); err != nil {
				return mp, fmt.Errorf("bad optional field %q: %w", opt, err)
			}
		case "propagate_from":
			if mp.PropagateFrom, err = strconv.Atoi(val); err != nil {
				return mp, fmt.Errorf("bad optional field %q: %w", opt, err)
			}
		case "unbindable":
			mp.Unbindable = true
		default:
			// proc(5): unknown optional fields must be ignored.
		}
	}

	mp.FSType = unescape(fields[sep+1])
	mp.Source = unescape(fields[sep+2])
	mp.SuperOptions = splitOptions(strings.Join(fields[sep+3:], " "))
	return mp, nil
}

func splitOptions(s string) []string {
	if s == "" {
		return nil
	}
	parts := strings.Split(s, ",")
	for i := range parts {
		parts[i] = unescape(parts[i])
	}
	return parts
}

// unescape turns the kernel's octal escapes (\040) back into bytes.
// Anything that is not a valid three-digit octal escape is kept as is.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && s[i+1] >= '0' && s[i+1] <= '3' && isOctal(s[i+2]) && isOctal(s[i+3]) {
			v := (s[i+1]-'0')*64 + (s[i+2]-'0')*8 + (s[i+3] - '0')
			b.WriteByte(v)
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }
