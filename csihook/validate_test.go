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
