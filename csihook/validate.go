package csihook

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// ErrInvalid is matched (errors.Is) by every error Validate returns and by
// Setup errors about a request that can never work as written.
var ErrInvalid = errors.New("invalid volume request")

// ErrPluginNotFound is matched by Setup errors about a missing or unhealthy
// plugin.
var ErrPluginNotFound = errors.New("CSI plugin not available")

// ErrOtherNamespace is matched by Setup errors about a volume that belongs
// to another Nomad namespace on this node.
var ErrOtherNamespace = errors.New("volume belongs to another namespace")

// ErrConflict is matched by Setup errors about a volume already in use on
// this node in a way the new request cannot share.
var ErrConflict = errors.New("volume in use")

// ErrUnsettled is matched, beside ErrConflict, by the Setup errors about a
// single-node-writer volume whose publish for another task of the
// allocation is being made or undone, and about a single-node-writer or
// multi-node-single-writer volume that a task of another allocation (one
// that is stopping) is still unpublishing (an unpublish that failed is
// retried in the background): unlike the other conflicts they pass once
// that settles, and the same request may then work.
var ErrUnsettled = errors.New("volume publish not settled")

// ErrBusy is matched by the Setup and Teardown errors of a setup or
// teardown whose deadline passed while another operation on its volume
// (another task's stage, publish or teardown of it, a repair) held the
// volume: it passes once that operation ends, as a plugin's ABORTED
// ("operation pending for volume") does.
var ErrBusy = errors.New("volume busy with another operation")

type busyError struct{ msg string }

// lockWaitError is the error of a wait for volume's lock (the plugin's
// volumeID) that ended with the waiter's context. Its deadline passed:
// ErrBusy, for a setup and for the teardown of an earlier start that a
// start waits for alike, since the operation holding the volume ends in
// time and the same request may then work. Canceled (the driver shutting
// down): the context's error, wrapped.
func lockWaitError(volume, volumeID, pluginID string, err error) error {
	what := fmt.Sprintf("gave up waiting for another operation on volume %q (volume_id %q, plugin %q) to finish", volume, volumeID, pluginID)
	if errors.Is(err, context.DeadlineExceeded) {
		return &busyError{what + ": " + err.Error()}
	}
	return fmt.Errorf("%s: %w", what, err)
}

func (e *busyError) Error() string        { return e.msg }
func (e *busyError) Is(target error) bool { return target == ErrBusy }

type invalidError struct{ msg string }

func (e *invalidError) Error() string        { return e.msg }
func (e *invalidError) Is(target error) bool { return target == ErrInvalid }

func invalidf(format string, args ...any) error {
	return &invalidError{msg: fmt.Sprintf(format, args...)}
}

var safeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)

// Limits on the sizes a job controls. Each is far above what the CSI spec
// allows (128 bytes for a string, 4 KiB for a map or for all mount flags
// together), so a request a plugin could accept never meets them; they
// keep every journal record, and so every batch, small enough to write
// and to read back (see maxFrame), and keep errors and events short.
const (
	// MaxIDBytes bounds plugin_id, volume_id and fs_type.
	MaxIDBytes = 1024
	// MaxDestinationBytes bounds destination (PATH_MAX).
	MaxDestinationBytes = 4096
	// MaxMapBytes bounds context, secrets and create.parameters, each: the
	// bytes of their keys and values together.
	MaxMapBytes = 64 << 10
	// MaxMountFlagsBytes bounds the bytes of all mount flags together.
	MaxMountFlagsBytes = 64 << 10
	// MaxVolumesPerTask bounds the volume blocks of one task, and
	// MaxTaskVolumeBytes all the bytes they hold together (requestBytes).
	// Each field has its limit above, but a hostile job could repeat
	// volume blocks at those limits up to what Nomad hands the driver in
	// one call (4 MiB), in each task of a job of many: every volume is a
	// record the journal keeps in memory and on disk (JSON, up to six
	// bytes a byte) and a set of plugin calls, so a few such jobs would
	// fill the driver's memory or the journal's disk and stall the
	// teardown of every other allocation's volumes. At most 64 volumes of
	// 16 KiB each per task is far above what a task needs (the CSI spec
	// allows 4 KiB a map).
	MaxVolumesPerTask  = 64
	MaxTaskVolumeBytes = 1 << 20
)

// requestBytes is what a request's fields a job controls hold together.
func requestBytes(req VolumeRequest) int {
	n := len(req.Name) + len(req.PluginID) + len(req.VolumeID) + len(req.Destination) + len(req.FSType) +
		len(strings.Join(req.MountFlags, "")) + mapBytes(req.Context) + mapBytes(req.Secrets)
	if req.Create != nil {
		n += mapBytes(req.Create.Parameters)
	}
	return n
}

// taskLimits reports a task whose volume blocks are too many or too large
// together.
func taskLimits(reqs []VolumeRequest) error {
	if len(reqs) > MaxVolumesPerTask {
		return invalidf("the task has %d volume blocks: a task may have at most %d", len(reqs), MaxVolumesPerTask)
	}
	n := 0
	for _, r := range reqs {
		n += requestBytes(r)
	}
	if n > MaxTaskVolumeBytes {
		return invalidf("the task's volume blocks hold %d bytes of names, ids, destinations, mount_options, context, secrets and create.parameters together: they must hold at most %d (%s)",
			n, MaxTaskVolumeBytes, humanBytes(MaxTaskVolumeBytes))
	}
	return nil
}

// Quoted quotes s for a message, cut short when it is long (64 bytes,
// then its length): what a job or a plugin wrote, of any size.
func Quoted(s string) string {
	const n = 64
	if len(s) > n {
		return fmt.Sprintf("%q... (%d bytes)", s[:n], len(s))
	}
	return fmt.Sprintf("%q", s)
}

func mapBytes(m map[string]string) int {
	n := 0
	for k, v := range m {
		n += len(k) + len(v)
	}
	return n
}

// sizeLimits reports each field of req larger than its limit.
func sizeLimits(req VolumeRequest, fail func(format string, args ...any)) {
	for _, f := range []struct {
		field string
		n     int
		max   int
		what  string
	}{
		{"plugin_id", len(req.PluginID), MaxIDBytes, "bytes"},
		{"volume_id", len(req.VolumeID), MaxIDBytes, "bytes"},
		{"destination", len(req.Destination), MaxDestinationBytes, "bytes"},
		{"mount_options.fs_type", len(req.FSType), MaxIDBytes, "bytes"},
		{"mount_options.mount_flags", len(strings.Join(req.MountFlags, "")), MaxMountFlagsBytes, "bytes of all flags together"},
		{"context", mapBytes(req.Context), MaxMapBytes, "bytes of keys and values together"},
		{"secrets", mapBytes(req.Secrets), MaxMapBytes, "bytes of keys and values together"},
	} {
		if f.n > f.max {
			fail("%s is %d %s: it must be at most %d (%s)", f.field, f.n, f.what, f.max, humanBytes(f.max))
		}
	}
	if c := req.Create; c != nil {
		if n := mapBytes(c.Parameters); n > MaxMapBytes {
			fail("create.parameters is %d bytes of keys and values together: it must be at most %d (%s)", n, MaxMapBytes, humanBytes(MaxMapBytes))
		}
	}
}

func humanBytes(n int) string {
	if n%1024 == 0 {
		return fmt.Sprintf("%d KiB", n/1024)
	}
	return fmt.Sprintf("%d bytes", n)
}

var accessModes = map[string]csi.VolumeCapability_AccessMode_Mode{
	AccessSingleNodeWriter:      csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
	AccessSingleNodeReaderOnly:  csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
	AccessMultiNodeReaderOnly:   csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
	AccessMultiNodeSingleWriter: csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
	AccessMultiNodeMultiWriter:  csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
}

// writerMode reports whether an access mode lets the node write.
func writerMode(mode string) bool {
	switch mode {
	case AccessSingleNodeWriter, AccessMultiNodeSingleWriter, AccessMultiNodeMultiWriter:
		return true
	}
	return false
}

func attachment(req VolumeRequest) string {
	if req.AttachmentMode == "" {
		return AttachmentFileSystem
	}
	return req.AttachmentMode
}

// Validate checks requests without asking any plugin: names, ids,
// destinations, modes, mount options and sizes. Every problem is reported,
// each matching ErrInvalid.
func (m *Manager) Validate(reqs []VolumeRequest) error { return validate(reqs) }

// ValidateRequests is Validate without a Manager: for a task's config,
// checked before anything is pulled or set up for it.
func ValidateRequests(reqs []VolumeRequest) error { return validate(reqs) }

func validate(reqs []VolumeRequest) error {
	if err := taskLimits(reqs); err != nil {
		return err
	}
	var errs []error
	names := map[string]bool{}
	dests := map[string]string{}
	// The blocks naming each volume: one volume twice in a task must
	// share as two tasks must (checkShare).
	seen := map[volKey]VolumeRequest{}
	for i, req := range reqs {
		label := Quoted(req.Name)
		if req.Name == "" {
			label = fmt.Sprintf("%q", fmt.Sprintf("#%d", i+1))
		}
		fail := func(format string, args ...any) {
			errs = append(errs, invalidf("volume %s: %s", label, fmt.Sprintf(format, args...)))
		}
		// Sizes first: the checks below quote values.
		before := len(errs)
		sizeLimits(req, fail)
		if len(errs) > before {
			continue
		}
		switch {
		case req.Name == "":
			fail("name must not be empty")
		case !safeName.MatchString(req.Name):
			fail("name must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
		case names[req.Name]:
			fail("name is used by more than one volume")
		}
		names[req.Name] = true

		if req.PluginID == "" {
			fail("plugin_id must not be empty")
		} else if why := badID(req.PluginID); why != "" {
			fail("plugin_id %q %s", req.PluginID, why)
		} else if strings.Contains(req.PluginID, "/") || req.PluginID == "." || req.PluginID == ".." {
			fail("plugin_id %q must not contain '/' or be '.' or '..'", req.PluginID)
		}
		if req.VolumeID == "" {
			fail("volume_id must not be empty")
		} else if why := badID(req.VolumeID); why != "" {
			fail("volume_id %s %s", Quoted(req.VolumeID), why)
		}
		if req.FSType != "" {
			if why := badID(req.FSType); why != "" {
				fail("mount_options.fs_type %q %s", req.FSType, why)
			}
		}

		switch dest := req.Destination; {
		case dest == "":
			fail("destination must not be empty")
		case !filepath.IsAbs(dest):
			fail("destination %q must be an absolute path", dest)
		case strings.ContainsRune(dest, 0):
			fail("destination %q must not hold a NUL byte", dest)
		case hasDotDot(dest):
			fail("destination %q must not contain '..'", dest)
		case filepath.Clean(dest) == "/":
			fail("destination must not be the task's root directory")
		default:
			clean := filepath.Clean(dest)
			if other, ok := dests[clean]; ok {
				fail("destination %q is also the destination of volume %s", dest, other)
			} else {
				dests[clean] = label
			}
		}

		mode := req.AccessMode
		if _, ok := accessModes[mode]; !ok {
			if mode == "" {
				fail("access_mode must be set to one of %s", modeList())
			} else {
				fail("access_mode %q is not supported: use one of %s", mode, modeList())
			}
		}

		switch att := attachment(req); att {
		case AttachmentFileSystem:
		case AttachmentBlockDevice:
			if req.FSType != "" || len(req.MountFlags) > 0 {
				fail("mount_options cannot be used with attachment_mode = %q", att)
			}
		default:
			fail("attachment_mode %q is not supported: use %q or %q", att, AttachmentFileSystem, AttachmentBlockDevice)
		}
		for _, f := range req.MountFlags {
			if f == "" || strings.ContainsRune(f, 0) {
				fail("mount_options.mount_flags must not hold empty values")
				break
			}
		}
		for k := range req.Secrets {
			if k == "" {
				fail("secrets must not have an empty key")
				break
			}
		}
		protoStrings(req, fail)
		for k := range req.Context {
			if k == "" {
				fail("context must not have an empty key")
				break
			}
		}
		if req.PluginID != "" && req.VolumeID != "" {
			k := volKey{req.PluginID, req.VolumeID}
			if first, ok := seen[k]; !ok {
				seen[k] = req
			} else if first.AccessMode != req.AccessMode || attachment(first) != attachment(req) || first.FSType != req.FSType {
				fail("volume_id %s of plugin %q is also volume %s, with access_mode = %q, attachment_mode = %q, fs_type = %q: give both blocks the same values",
					Quoted(req.VolumeID), req.PluginID, Quoted(first.Name), first.AccessMode, attachment(first), first.FSType)
			} else if req.AccessMode == AccessSingleNodeWriter && (!slices.Equal(first.MountFlags, req.MountFlags) || !maps.Equal(first.Context, req.Context)) {
				// Both blocks bind the one publish (allocShare), as two
				// volume_mount blocks of one group volume do in Nomad:
				// what goes with the publish is the first block's.
				fail("volume_id %s of plugin %q is also volume %s, and single-node-writer publishes it once on a node, for both blocks: give both the same mount_options.mount_flags and context",
					Quoted(req.VolumeID), req.PluginID, Quoted(first.Name))
			}
		}
		if err := checkGroup(req.MountGroup); err != nil {
			fail("%v", err)
		}
		if req.ApplyMountGroup {
			switch {
			case attachment(req) == AttachmentBlockDevice:
				fail("mount_group = true cannot be used with attachment_mode = %q: a block device has no root directory to give the task's group", AttachmentBlockDevice)
			case req.ReadOnly || !writerMode(req.AccessMode):
				fail("mount_group = true makes the volume writable by the task's group, which a read-only volume cannot be: drop mount_group or use a writer access_mode without read_only")
			}
		}
		if c := req.Create; c != nil {
			if c.CapacityMin < 0 || c.CapacityMax < 0 {
				fail("create.capacity_min and create.capacity_max must not be negative")
			} else if c.CapacityMax > 0 && c.CapacityMin > c.CapacityMax {
				fail("create.capacity_min (%d bytes) must not exceed create.capacity_max (%d bytes)", c.CapacityMin, c.CapacityMax)
			}
		}
	}
	return errors.Join(errs...)
}

// protoStrings reports what a request would send the plugin that cannot
// go as it is. Every value goes as a protobuf string, which must be UTF-8:
// a request holding other bytes is not sent at all (grpc fails to marshal
// it, Internal, on every retry). Secret keys are held to the CSI spec's
// Secrets Requirements: "Each key MUST consist of alphanumeric characters,
// '-', '_' or '.'", the keys a Kubernetes Secret may have. A secret key or
// value is never quoted; a secrets_file's bytes are what a template
// rendered.
func protoStrings(req VolumeRequest, fail func(format string, args ...any)) {
	for i, f := range req.MountFlags {
		if !utf8.ValidString(f) {
			fail("mount_options.mount_flags: flag %d is not valid UTF-8: the plugin gets it as a string, which must be", i+1)
			break
		}
	}
	stringMap := func(field string, m map[string]string) {
		for _, k := range slices.Sorted(maps.Keys(m)) {
			switch {
			case !utf8.ValidString(k):
				fail("%s: a key is not valid UTF-8: the plugin gets it as a string, which must be", field)
				return
			case !utf8.ValidString(m[k]):
				fail("%s: key %s has a value that is not valid UTF-8: the plugin gets it as a string, which must be", field, Quoted(k))
				return
			}
		}
	}
	stringMap("context", req.Context)
	if req.Create != nil {
		stringMap("create.parameters", req.Create.Parameters)
	}
	for _, k := range slices.Sorted(maps.Keys(req.Secrets)) {
		if k != "" && !secretKey.MatchString(k) {
			fail("secrets: a key holds a character other than letters, digits, '-', '_' or '.', which the CSI spec allows in secret keys (the key is not shown: it may be secret)")
			break
		}
		if !utf8.ValidString(req.Secrets[k]) {
			fail("secrets: a value is not valid UTF-8 (neither key nor value is shown: they may be secret): the CSI spec sends secrets as strings; encode binary secrets (as base64, say) the way the plugin documents")
			break
		}
	}
}

// secretKey is a secret's key as the CSI spec allows it.
var secretKey = regexp.MustCompile(`^[A-Za-z0-9._-]+$`)

// badID says what is wrong with an id a job wrote (plugin_id, volume_id,
// fs_type), or "". A plugin compares ids byte for byte: "db " or "db\n"
// is another volume than "db", which the job's author cannot see in the
// job, in "nomad alloc status" or in the operator's listing, and a plugin
// that trims or folds them would serve a look-alike of another volume.
// Leading or trailing white space, control characters (C0, DEL, C1),
// bidirectional formatting characters, which reorder what a terminal
// shows, and bytes that are not UTF-8, which protobuf cannot send as a
// string, are refused.
func badID(s string) string {
	if !utf8.ValidString(s) {
		return "is not valid UTF-8: write the id as the plugin knows it"
	}
	first, _ := utf8.DecodeRuneInString(s)
	last, _ := utf8.DecodeLastRuneInString(s)
	if unicode.IsSpace(first) || unicode.IsSpace(last) {
		return "has leading or trailing white space: remove it (the plugin would see another id)"
	}
	for _, r := range s {
		switch {
		case unicode.IsControl(r):
			return fmt.Sprintf("holds the control character %U: remove it (the plugin would see another id)", r)
		case bidiControl(r):
			return fmt.Sprintf("holds the bidirectional formatting character %U: remove it (it reorders how the id is shown)", r)
		}
	}
	return ""
}

// bidiControl reports the Unicode characters that change the display order
// of text (embeddings, overrides, isolates and marks).
func bidiControl(r rune) bool {
	return r == 0x061C || r == 0x200E || r == 0x200F || (r >= 0x202A && r <= 0x202E) || (r >= 0x2066 && r <= 0x2069)
}

func hasDotDot(p string) bool {
	for _, part := range strings.Split(p, "/") {
		if part == ".." {
			return true
		}
	}
	return false
}

func modeList() string {
	return strings.Join([]string{
		AccessSingleNodeWriter, AccessSingleNodeReaderOnly, AccessMultiNodeReaderOnly,
		AccessMultiNodeSingleWriter, AccessMultiNodeMultiWriter,
	}, ", ")
}

// capability builds the CSI volume capability of a request.
func capability(accessMode, attachmentMode, fsType string, mountFlags []string) *csi.VolumeCapability {
	vc := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: accessModes[accessMode]},
	}
	if attachmentMode == AttachmentBlockDevice {
		vc.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		vc.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
			FsType: fsType, MountFlags: append([]string(nil), mountFlags...),
		}}
	}
	return vc
}
