package csihook

import (
	"context"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// TestValidate_SizeLimits: each size a job controls has a limit, far above
// the CSI spec's; a request at the limit passes, one byte over is refused
// before any plugin call with an error that names the field and the limit
// and quotes no long value (nor any secret).
func TestValidate_SizeLimits(t *testing.T) {
	fill := func(n int) string { return strings.Repeat("x", n) }
	// A map of n bytes of keys and values.
	mapOf := func(n int) map[string]string { return map[string]string{"k": canary + fill(n-1-len(canary))} }
	cases := []struct {
		field string
		limit int
		set   func(r *VolumeRequest, n int)
		want  string
	}{
		{"plugin_id", MaxIDBytes, func(r *VolumeRequest, n int) { r.PluginID = fill(n) },
			"plugin_id is 1025 bytes: it must be at most 1024 (1 KiB)"},
		{"volume_id", MaxIDBytes, func(r *VolumeRequest, n int) { r.VolumeID = fill(n) },
			"volume_id is 1025 bytes: it must be at most 1024 (1 KiB)"},
		{"destination", MaxDestinationBytes, func(r *VolumeRequest, n int) { r.Destination = "/" + fill(n-1) },
			"destination is 4097 bytes: it must be at most 4096 (4 KiB)"},
		{"fs_type", MaxIDBytes, func(r *VolumeRequest, n int) { r.FSType = fill(n) },
			"mount_options.fs_type is 1025 bytes: it must be at most 1024 (1 KiB)"},
		{"mount_flags", MaxMountFlagsBytes, func(r *VolumeRequest, n int) { r.MountFlags = []string{"ro", fill(n - 2)} },
			"mount_options.mount_flags is 65537 bytes of all flags together: it must be at most 65536 (64 KiB)"},
		{"context", MaxMapBytes, func(r *VolumeRequest, n int) { r.Context = mapOf(n) },
			"context is 65537 bytes of keys and values together: it must be at most 65536 (64 KiB)"},
		{"secrets", MaxMapBytes, func(r *VolumeRequest, n int) { r.Secrets = mapOf(n) },
			"secrets is 65537 bytes of keys and values together: it must be at most 65536 (64 KiB)"},
		{"create.parameters", MaxMapBytes, func(r *VolumeRequest, n int) { r.Create = &CreateRequest{Parameters: mapOf(n)} },
			"create.parameters is 65537 bytes of keys and values together: it must be at most 65536 (64 KiB)"},
	}
	for _, tc := range cases {
		t.Run(tc.field, func(t *testing.T) {
			r := req("data", "vol1", "/data")
			tc.set(&r, tc.limit)
			must.NoError(t, validate([]VolumeRequest{r}))

			tc.set(&r, tc.limit+1)
			err := validate([]VolumeRequest{r})
			must.ErrorIs(t, err, ErrInvalid)
			must.EqError(t, err, `volume "data": `+tc.want)
			must.StrNotContains(t, err.Error(), canary)

			// Setup refuses it before any call or record.
			h := newHarness(t)
			_, err = h.m.Setup(context.Background(), "t", []VolumeRequest{r})
			must.ErrorContains(t, err, tc.want)
			must.SliceEmpty(t, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
		})
	}

	// A long name is quoted cut short.
	r := req(fill(100_000), "vol1", "/data")
	err := validate([]VolumeRequest{r})
	must.ErrorContains(t, err, "name must be 1-63")
	must.Less(t, 400, len(err.Error()))
}

// TestValidate_IDCharacters: an id a job writes with white space around
// it, a control character, a bidirectional formatting character or bytes
// that are not UTF-8 is another id to the plugin than the one the job's
// author sees: it is refused before any call, naming the field and what to
// do, with the value quoted so that the character shows. Ids with inner
// spaces and non-ASCII letters pass: plugins may use them.
func TestValidate_IDCharacters(t *testing.T) {
	bad := []struct {
		name string
		set  func(r *VolumeRequest)
		want string
	}{
		{"volume_id trailing space", func(r *VolumeRequest) { r.VolumeID = "acc-hold-1 " },
			`volume_id "acc-hold-1 " has leading or trailing white space: remove it`},
		{"volume_id leading tab", func(r *VolumeRequest) { r.VolumeID = "\tacc-hold-1" },
			`volume_id "\tacc-hold-1" has leading or trailing white space`},
		{"volume_id trailing newline", func(r *VolumeRequest) { r.VolumeID = "db\n" },
			`volume_id "db\n" has leading or trailing white space`},
		{"volume_id no-break space", func(r *VolumeRequest) { r.VolumeID = "db\u00a0" },
			`volume_id "db\u00a0" has leading or trailing white space`},
		{"volume_id NUL", func(r *VolumeRequest) { r.VolumeID = "a\x00b" },
			`volume_id "a\x00b" holds the control character U+0000`},
		{"volume_id escape", func(r *VolumeRequest) { r.VolumeID = "a\x1b[31mb" },
			`volume_id "a\x1b[31mb" holds the control character U+001B`},
		{"volume_id DEL", func(r *VolumeRequest) { r.VolumeID = "a\x7fb" },
			`volume_id "a\x7fb" holds the control character U+007F`},
		{"volume_id C1", func(r *VolumeRequest) { r.VolumeID = "a\u0085b" },
			`volume_id "a\u0085b" holds the control character U+0085`},
		{"volume_id bidi override", func(r *VolumeRequest) { r.VolumeID = "db\u202e1-dloh" },
			`volume_id "db\u202e1-dloh" holds the bidirectional formatting character U+202E`},
		{"volume_id not UTF-8", func(r *VolumeRequest) { r.VolumeID = "db\xff" },
			`volume_id "db\xff" is not valid UTF-8`},
		{"plugin_id trailing space", func(r *VolumeRequest) { r.PluginID = "fixture " },
			`plugin_id "fixture " has leading or trailing white space`},
		{"plugin_id control", func(r *VolumeRequest) { r.PluginID = "fix\rture" },
			`plugin_id "fix\rture" holds the control character U+000D`},
		{"fs_type trailing space", func(r *VolumeRequest) { r.FSType = "ext4 " },
			`mount_options.fs_type "ext4 " has leading or trailing white space`},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			r := req("data", "vol1", "/data")
			tc.set(&r)
			err := validate([]VolumeRequest{r})
			must.ErrorIs(t, err, ErrInvalid)
			must.ErrorContains(t, err, `volume "data": `+tc.want)

			h := newHarness(t)
			_, err = h.m.Setup(context.Background(), "t", []VolumeRequest{r})
			must.ErrorContains(t, err, tc.want)
			must.SliceEmpty(t, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
		})
	}
	for _, id := range []string{"acc hold 1", "données-1", "pvc-0b8e/part:1", "a"} {
		r := req("data", id, "/data")
		must.NoError(t, validate([]VolumeRequest{r}), must.Sprintf("volume_id %q", id))
	}
}
