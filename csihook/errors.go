package csihook

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// OpError is a failed CSI call (or a failure to reach the plugin for one),
// after retries. Message is the plugin's message with every secret value
// removed, Hint says what to do. It does not wrap the plugin's error, so
// nothing unredacted can be reached through it.
type OpError struct {
	// Method is one of the Method* names.
	Method   string
	Volume   string
	VolumeID string
	PluginID string
	Code     codes.Code
	Message  string
	Hint     string
}

func (e *OpError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "failed to %s %q (volume_id %q, plugin %q): %s", verb(e.Method), e.Volume, e.VolumeID, e.PluginID, e.Code)
	if e.Message != "" {
		b.WriteString(": ")
		b.WriteString(e.Message)
	}
	if e.Hint != "" {
		b.WriteString(": ")
		b.WriteString(e.Hint)
	}
	return b.String()
}

// Event is the task event text of the failure.
func (e *OpError) Event() string {
	msg := fmt.Sprintf("%s %q failed (%s", gerund(e.Method), e.Volume, e.Code)
	if e.Message != "" {
		msg += ": " + e.Message
	}
	msg += ")"
	if e.Hint != "" {
		msg += ": " + e.Hint
	}
	return msg
}

// Code returns the gRPC code of err: an OpError's code, a status error's
// code, DeadlineExceeded or Canceled for context errors, OK for nil and
// Unknown otherwise.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	var oe *OpError
	if errors.As(err, &oe) {
		return oe.Code
	}
	return csiclient.Code(err)
}

// message returns the plugin's message of a call error.
func message(err error) string {
	if st, ok := status.FromError(err); ok {
		return st.Message()
	}
	return err.Error()
}

// permanent reports whether a teardown failure cannot get better by
// waiting: the request itself is wrong for the plugin.
// Every call failure in err must be so.
func permanent(err error) bool {
	oes := opErrors(err)
	if len(oes) == 0 {
		return false
	}
	for _, oe := range oes {
		if oe.Code != codes.InvalidArgument && oe.Code != codes.Unimplemented {
			return false
		}
	}
	return true
}

// stageRefused reports whether err, from NodeStageVolume, is the
// plugin's final answer that it did not stage the volume: a code the
// driver never retries for the call (csiclient.Rules), such as
// InvalidArgument, NotFound, FailedPrecondition, PermissionDenied or
// Internal. Not so an outcome the driver cannot know: a retryable code
// whose retries ran out (DeadlineExceeded, the plugin gone or busy:
// Unavailable, ResourceExhausted, Aborted), Canceled (the driver's own
// context ended mid-call) and Unknown (an answer with no status, from
// gRPC or the connection as much as from the plugin): the plugin may
// have staged, so the record stays staging for recovery to settle (see
// volRecord.needsSecrets).
func stageRefused(err error) bool {
	var oe *OpError
	if !errors.As(err, &oe) || oe.Method != MethodNodeStageVolume {
		return false
	}
	switch oe.Code {
	case codes.OK, codes.Canceled, codes.Unknown:
		return false
	}
	return !csiclient.Retryable(MethodNodeStageVolume, oe.Code)
}

var verbs = map[string][2]string{
	MethodNodeGetInfo:               {"read node info for volume", "Reading node info for volume"},
	MethodCreateVolume:              {"create volume", "Creating volume"},
	MethodControllerPublishVolume:   {"attach volume", "Attaching volume"},
	MethodControllerUnpublishVolume: {"detach volume", "Detaching volume"},
	MethodNodeStageVolume:           {"stage volume", "Staging volume"},
	MethodNodeUnstageVolume:         {"unstage volume", "Unstaging volume"},
	MethodNodePublishVolume:         {"publish volume", "Publishing volume"},
	MethodNodeUnpublishVolume:       {"unpublish volume", "Unpublishing volume"},
	MethodControllerExpandVolume:    {"expand volume", "Expanding volume"},
	MethodNodeExpandVolume:          {"expand the file system of volume", "Expanding the file system of volume"},
}

func verb(method string) string {
	if v, ok := verbs[method]; ok {
		return v[0]
	}
	return "call " + method + " for volume"
}

func gerund(method string) string {
	if v, ok := verbs[method]; ok {
		return v[1]
	}
	return "Calling " + method + " for volume"
}

// hint maps a final code of a call to what the operator should do.
func hint(method string, code codes.Code, volumeID, pluginID, nodeID string) string {
	switch code {
	case codes.NotFound:
		switch method {
		case MethodControllerPublishVolume:
			return fmt.Sprintf("volume %q or node %q does not exist on plugin %q: create the volume or add a create block, and check the plugin's node id", volumeID, nodeID, pluginID)
		case MethodNodeStageVolume, MethodNodePublishVolume:
			return fmt.Sprintf("volume %q does not exist on plugin %q: create it or add a create block", volumeID, pluginID)
		}
	case codes.AlreadyExists:
		if method == MethodCreateVolume {
			return fmt.Sprintf("a volume named %q already exists on plugin %q with another size or parameters: change volume_id or make the create block match", volumeID, pluginID)
		}
		return fmt.Sprintf("volume %q is already in use on this node with another access mode, attachment mode or mount options: stop the other task or make the volume blocks match", volumeID)
	case codes.FailedPrecondition:
		if method == MethodControllerPublishVolume {
			return fmt.Sprintf("volume %q is attached to another node in a way this request cannot share: stop the task using it there or use a multi-node access mode", volumeID)
		}
		return fmt.Sprintf("plugin %q cannot do this to volume %q in its current state: see the plugin's logs", pluginID, volumeID)
	case codes.InvalidArgument:
		return fmt.Sprintf("plugin %q rejected the request: check access_mode, attachment_mode, mount_options, context and create parameters", pluginID)
	case codes.Unimplemented:
		return fmt.Sprintf("plugin %q does not implement %s: check it is the right plugin and that its capabilities are current", pluginID, method)
	case codes.OutOfRange:
		return fmt.Sprintf("plugin %q cannot make a volume of that size: change create.capacity_min or create.capacity_max", pluginID)
	case codes.ResourceExhausted:
		if method == MethodControllerPublishVolume {
			return fmt.Sprintf("node %q has as many volumes of plugin %q attached as it can take: stop a task using one", nodeID, pluginID)
		}
		return fmt.Sprintf("plugin %q is out of resources: free some or retry later", pluginID)
	case codes.PermissionDenied, codes.Unauthenticated:
		return fmt.Sprintf("plugin %q refused the credentials: check the volume's secrets", pluginID)
	case codes.Unavailable:
		return fmt.Sprintf("plugin %q is not answering: check that its task is running and healthy", pluginID)
	case codes.DeadlineExceeded:
		return fmt.Sprintf("plugin %q did not answer in time: check its logs and health", pluginID)
	case codes.Aborted:
		return fmt.Sprintf("plugin %q has another operation on volume %q in progress: retry later", pluginID, volumeID)
	case codes.Internal, codes.Unknown:
		return fmt.Sprintf("see the logs of plugin %q", pluginID)
	case codes.Canceled:
		return fmt.Sprintf("plugin %q says the call was cancelled: retry, and see its logs if it keeps happening", pluginID)
	case codes.DataLoss:
		return fmt.Sprintf("plugin %q reports lost or corrupt data on volume %q: check the volume's storage before using it again", pluginID, volumeID)
	}
	return ""
}

const redacted = "<redacted>"

// redact replaces every secret value in s, in each form a plugin's message
// may spell it (see secretForms). Every byte of s that lies in any form's
// occurrence is covered, and each run of covered bytes becomes one marker,
// in one pass over the original s: secrets that overlap are removed whole,
// and a marker is never itself searched again. Replacing one form after
// another did search it: a job's secrets that are pieces of the marker
// ("e", "<r", ...) put new markers inside the old ones at every step, so a
// few dozen of them grew a short message exponentially, to gigabytes, in
// the driver's memory.
func redact(s string, secrets ...map[string]string) string {
	var vals []string
	for _, m := range secrets {
		for _, v := range m {
			if v != "" {
				vals = append(vals, secretForms(v)...)
			}
		}
	}
	if len(vals) == 0 || s == "" {
		return s
	}
	covered := make([]bool, len(s))
	found := false
	for _, v := range vals {
		if coverAll(s, v, covered) {
			found = true
		}
	}
	if !found {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		if !covered[i] {
			b.WriteByte(s[i])
			i++
			continue
		}
		b.WriteString(redacted)
		for i < len(s) && covered[i] {
			i++
		}
	}
	return b.String()
}

// coverAll marks the bytes of every occurrence of v in s, overlapping ones
// too ("aa" in "aaa"), and reports whether there was one. It runs in
// O(len(s)+len(v)) (Knuth-Morris-Pratt): a search from each match's next
// byte would compare v again and again where it repeats itself.
func coverAll(s, v string, covered []bool) bool {
	if len(v) == 0 || len(v) > len(s) {
		return false
	}
	// fail[i] is the length of the longest proper prefix of v[:i+1] that
	// is also its suffix.
	fail := make([]int, len(v))
	for i, k := 1, 0; i < len(v); i++ {
		for k > 0 && v[i] != v[k] {
			k = fail[k-1]
		}
		if v[i] == v[k] {
			k++
		}
		fail[i] = k
	}
	found := false
	end := 0 // how far s is covered already by v's earlier occurrences
	for i, k := 0, 0; i < len(s); i++ {
		for k > 0 && s[i] != v[k] {
			k = fail[k-1]
		}
		if s[i] == v[k] {
			k++
		}
		if k == len(v) {
			start := i + 1 - len(v)
			for j := max(start, end); j <= i; j++ {
				covered[j] = true
			}
			end = i + 1
			found = true
			k = fail[k-1]
		}
	}
	return found
}

// secretForms is a secret as it is and as a plugin that echoes its request
// writes it: Go-quoted (%q, %+v of a request, protobuf's text format:
// `a"b` as `a\"b`), Go-quoted in ASCII (%+q) and JSON-encoded, each
// without its quotes. Only the value itself was redacted before, so a
// secret holding a quote, a backslash or a control character reached the
// task's events, `nomad alloc status` and the agent's log in full from a
// plugin that printed it with %q: readable by whoever may read the job,
// which for a secrets_file secret (from Vault, say) is more than may read
// the secret.
func secretForms(v string) []string {
	forms := []string{v}
	add := func(quoted string) {
		if len(quoted) >= 2 {
			quoted = quoted[1 : len(quoted)-1]
		}
		if quoted != "" && !slices.Contains(forms, quoted) {
			forms = append(forms, quoted)
		}
	}
	add(strconv.Quote(v))
	add(strconv.QuoteToASCII(v))
	if b, err := json.Marshal(v); err == nil {
		add(string(b))
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if enc.Encode(v) == nil {
		add(strings.TrimSuffix(buf.String(), "\n"))
	}
	// A plugin that puts a credential in a URL (an object store's
	// "s3://key:secret@bucket", say) writes it percent-encoded: cloud
	// secret keys are full of "/" and "+". And one that prints its request
	// in protobuf's C text format escapes every byte outside printable
	// ASCII in octal ("é" as \303\251).
	for _, f := range []string{url.QueryEscape(v), url.PathEscape(v), strings.ReplaceAll(url.QueryEscape(v), "+", "%20"), cEscape(v)} {
		add(`"` + f + `"`)
	}
	return forms
}

// cEscape is v as protobuf's C text format writes a string: quote,
// apostrophe and backslash escaped, \n \r \t, and every other byte outside
// printable ASCII as three octal digits.
func cEscape(v string) string {
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\n':
			b.WriteString(`\n`)
		case c == '\r':
			b.WriteString(`\r`)
		case c == '\t':
			b.WriteString(`\t`)
		case c == '"' || c == '\'' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c >= 0x7f:
			fmt.Fprintf(&b, `\%03o`, c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}
