package driver

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/hashicorp/nomad/helper/pluginutils/hclspecutils"
	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// fuzzCanary stands in for every secret value before validation: no error
// may show it.
const fuzzCanary = "s3cr3t-FUZZ-canary"

// decodeSpec turns a task's config, as the job (HCL or JSON through the
// API) gives it to the Nomad client, into the driver's struct the way the
// client and the driver do: hclutils.ParseHclInterface with the driver's
// spec, cty msgpack in the TaskConfig, DecodeDriverConfig. ok is false
// when the spec refuses the config (Nomad fails the task before the
// driver sees it); err when the spec accepts what the struct cannot
// decode (a codec tag or type that does not match its spec would fail
// every such task).
func decodeSpec(spec *hclspec.Spec, config any, out any) (ok bool, err error) {
	dec, diags := hclspecutils.Convert(spec)
	if diags.HasErrors() {
		return false, fmt.Errorf("the spec does not convert: %v", diags)
	}
	val, diags, _ := hclutils.ParseHclInterface(config, dec, nil)
	if diags.HasErrors() {
		return false, nil
	}
	var cfg drivers.TaskConfig
	if err := cfg.EncodeDriverConfig(val); err != nil {
		return false, nil
	}
	if err := cfg.DecodeDriverConfig(out); err != nil {
		return false, fmt.Errorf("the spec accepted a config the struct cannot decode: %w", err)
	}
	return true, nil
}

// checkCleanError fails when an error the driver returns for a task's
// config is not one a user can read in a task event: every line non-empty,
// starting lowercase, with no control characters (values from the job are
// quoted) and no secret.
func checkCleanError(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		return
	}
	msg := err.Error()
	if !utf8.ValidString(msg) {
		t.Fatalf("error is not valid UTF-8: %q", msg)
	}
	if strings.Contains(msg, fuzzCanary) {
		t.Fatalf("error shows a secret: %q", msg)
	}
	for _, line := range strings.Split(msg, "\n") {
		r, _ := utf8.DecodeRuneInString(line)
		if line == "" || unicode.IsUpper(r) {
			t.Fatalf("error line %q of %q is empty or not lowercase", line, msg)
		}
		if i := strings.IndexFunc(line, unicode.IsControl); i >= 0 {
			t.Fatalf("error line %q holds a control character at %d", line, i)
		}
	}
}

// FuzzTaskConfig feeds a task's config, as JSON (what a job submitted
// through the API holds, and what the client encodes an HCL job's config
// to before decoding it with the driver's spec), through decoding and the
// driver's static checks: TaskConfig.validate, the privileged policy,
// volumeRequests (with parseSize) and csihook's Validate. None may panic;
// errors must be clean (checkCleanError); a config that passes has only
// what the checks promise (absolute, distinct volume destinations other
// than "/", no "..", plugin ids that are one path element, sizes in
// order).
func FuzzTaskConfig(f *testing.F) {
	for _, seed := range []string{
		`{"command": "/bin/true"}`,
		`{"command": "/bin/sh", "args": ["-c", "echo hi"], "work_dir": "/tmp", "pid_mode": "host", "ipc_mode": "private", "cap_add": ["NET_ADMIN"], "cap_drop": ["all"]}`,
		`{"command": "/usr/bin/app", "privileged": true, "csi_plugin": {"id": "hostpath", "type": "node"}}`,
		`{"command": "/usr/bin/app", "csi_plugin": [{"id": "ctl", "type": "controller", "mount_dir": "/csi"}]}`,
		`{"command": "/bin/app", "volume": {"data": {"plugin_id": "hostpath", "volume_id": "db", "destination": "/srv/data",
			"read_only": true, "access_mode": "single-node-reader-only", "attachment_mode": "file-system",
			"context": {"zone": "a"}, "secrets": {"token": "x"},
			"mount_options": {"fs_type": "ext4", "mount_flags": ["noatime"]},
			"create": {"capacity_min": "1GiB", "capacity_max": "2GiB", "parameters": {"type": "ext4"}}}}}`,
		`{"command": "/bin/app", "volume": [{"a": [{"plugin_id": "p", "volume_id": "v", "destination": "/a"}]}, {"b": [{"plugin_id": "p", "volume_id": "w", "destination": "/a/../b"}]}]}`,
		`{"command": "/bin/app", "volume": {"blk": {"plugin_id": "p", "volume_id": "v", "destination": "/dev/xvdb", "attachment_mode": "block-device", "create": {"capacity_min": "10 MB", "capacity_max": "1,5kb"}}}}`,
		`{"command": " ", "work_dir": "rel", "pid_mode": "bogus"}`,
		`{"command": "/bin/app", "csi_plugin": {"id": "../x", "type": "node", "mount_dir": "/"}}`,
		`{"command": "/bin/app", "volume": {"x": {"plugin_id": "p/q", "volume_id": "", "destination": "/"}}}`,
	} {
		f.Add([]byte(seed), false)
		f.Add([]byte(seed), true)
	}

	var agent Config
	if ok, err := decodeSpec(configSpec, map[string]any{"enabled": true}, &agent); !ok {
		f.Fatalf("the agent config spec refuses its defaults: %v", err)
	}
	f.Fuzz(func(t *testing.T, data []byte, allowPrivileged bool) {
		var config any
		if err := json.Unmarshal(data, &config); err != nil {
			return
		}
		var tc TaskConfig
		ok, err := decodeSpec(taskConfigSpec, config, &tc)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return
		}
		for name, v := range tc.Volumes {
			for k := range v.Secrets {
				v.Secrets[k] = fuzzCanary
			}
			tc.Volumes[name] = v
		}
		conf := agent
		conf.AllowPrivileged = allowPrivileged
		cfg := &drivers.TaskConfig{ID: "alloc-1/web/abc", Name: "web", AllocID: "alloc-1"}

		err = tc.validate(&conf)
		checkCleanError(t, err)
		if err == nil {
			_, err = authorize(&conf, cfg, &tc, &executor.Spec{Command: tc.Command, Dir: "/"}, taskImage{})
			checkCleanError(t, err)
		}
		reqs, rerr := volumeRequests(tc.Volumes)
		checkCleanError(t, rerr)
		if rerr != nil {
			return
		}
		verr := (*csihook.Manager)(nil).Validate(reqs)
		checkCleanError(t, verr)
		if err != nil || verr != nil {
			return
		}

		if tc.Privileged {
			// The agent's config has no privileged_grant.
			t.Fatalf("privileged task accepted without a privileged_grant (allow_privileged = %v)", allowPrivileged)
		}
		if p := tc.CSIPlugin; p != nil && (p.ID == "" || strings.ContainsAny(p.ID, "/\x00") || p.ID == "." || p.ID == "..") {
			t.Fatalf("csi_plugin id %q accepted: it is not one path element", p.ID)
		}
		checkAccepted(t, reqs)
	})
}

// checkAccepted fails when a volume request that passed every check has
// what the checks promise it cannot: a destination that is relative, "/"
// or another's, a plugin id that is not one path element, sizes out of
// order.
func checkAccepted(t *testing.T, reqs []csihook.VolumeRequest) {
	t.Helper()
	dests := map[string]bool{}
	for _, r := range reqs {
		clean := filepath.Clean(r.Destination)
		if !filepath.IsAbs(r.Destination) || clean == "/" || dests[clean] {
			t.Fatalf("volume %q destination %q accepted", r.Name, r.Destination)
		}
		dests[clean] = true
		if strings.ContainsAny(r.PluginID, "/\x00") || r.PluginID == "" || r.PluginID == "." || r.PluginID == ".." {
			t.Fatalf("volume %q plugin_id %q accepted", r.Name, r.PluginID)
		}
		if c := r.Create; c != nil && (c.CapacityMin < 0 || c.CapacityMax < 0 || (c.CapacityMax > 0 && c.CapacityMin > c.CapacityMax)) {
			t.Fatalf("volume %q sizes %d..%d accepted", r.Name, c.CapacityMin, c.CapacityMax)
		}
	}
}

// FuzzVolumeRequest fills one volume block's fields directly (faster to
// reach odd values than through JSON) and runs volumeRequests and
// csihook's Validate: errors clean, accepted requests as checkAccepted
// wants.
func FuzzVolumeRequest(f *testing.F) {
	f.Add("data", "hostpath", "db", "/srv/data", "single-node-writer", "file-system", "ext4", "noatime", "1GiB", "2GiB", false)
	f.Add("blk", "p", "v", "/dev/xvdb", "single-node-reader-only", "block-device", "", "", "", "10MiB", true)
	f.Add("x", "p/q", "", "relative", "bogus", "bogus", "", "", "2k", "1k", true)
	f.Fuzz(func(t *testing.T, name, plugin, volume, dest, access, attach, fsType, flag, capMin, capMax string, readOnly bool) {
		v := VolumeConfig{PluginID: plugin, VolumeID: volume, Destination: dest, ReadOnly: readOnly,
			AccessMode: access, AttachmentMode: attach, Secrets: map[string]string{"token": fuzzCanary}}
		if fsType != "" || flag != "" {
			v.MountOptions = &MountOptions{FSType: fsType, MountFlags: []string{flag}}
		}
		if capMin != "" || capMax != "" {
			v.Create = &VolumeCreateBlock{CapacityMin: capMin, CapacityMax: capMax}
		}
		// A second volume, so that destinations can collide.
		vols := map[string]VolumeConfig{name: v, "zz-other": {PluginID: "p", VolumeID: "o", Destination: "/other"}}
		reqs, err := volumeRequests(vols)
		checkCleanError(t, err)
		if err != nil {
			return
		}
		err = (*csihook.Manager)(nil).Validate(reqs)
		checkCleanError(t, err)
		if err == nil {
			checkAccepted(t, reqs)
		}
	})
}

// FuzzParseSize: any string either fails with a message naming the volume,
// the field and the value, or reads as a size from 0 to 2^62 bytes. Sizes
// written with a unit read as that many units (the seeds' forms).
func FuzzParseSize(f *testing.F) {
	for _, s := range []string{"", "0", "1", "512MiB", "10GiB", "1.5 GB", "1,024 kB", "1e3", "-1", "18446744073709551615",
		"99999999999999999999999EiB", "NaN", "Inf", "0x10", "1 TiB ", " 1", "١٢٣", "1.", ".5k", "1,,,0b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := parseSize("v", "capacity_min", s)
		if err != nil {
			msg := err.Error()
			if !strings.HasPrefix(msg, `volume "v": create capacity_min `+strconv.Quote(s)) {
				t.Fatalf("error %q does not name the volume, field and value %q", msg, s)
			}
			checkCleanError(t, err)
			return
		}
		if n < 0 || n > 1<<62 {
			t.Fatalf("parseSize(%q) = %d, outside 0..2^62", s, n)
		}
		if s == "" && n != 0 {
			t.Fatalf("parseSize(\"\") = %d", n)
		}
		// The same size in KiB (when whole) reads as 1024 times as much.
		if n > 0 && n <= 1<<50 && strings.TrimSpace(s) == s && !strings.ContainsAny(s, ".,eE") && isDigits(s) {
			k, err := parseSize("v", "capacity_min", s+"KiB")
			if err != nil || k != n*1024 {
				t.Fatalf("parseSize(%qKiB) = %d, %v; want %d", s, k, err, n*1024)
			}
		}
	})
}

func isDigits(s string) bool {
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return s != ""
}
