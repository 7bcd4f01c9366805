package csihook

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/protobuf/proto"
)

// The strings a job gives a volume go to the plugin as protobuf strings,
// which must be UTF-8: a request holding other bytes cannot be sent at all
// (grpc fails to marshal it, Internal, the same on every retry). And the
// CSI spec's Secrets Requirements: "Each key MUST consist of alphanumeric
// characters, '-', '_' or '.'". Both are refused when the task starts,
// before any call or record, naming the field and quoting no secret.
// secrets_file is how such bytes get in: it is what a template rendered.
func TestSpec_FieldsSentAsProtoStrings(t *testing.T) {
	// What the wire does with such a request, which this test's refusals
	// stand in for: the fake client does not marshal.
	_, err := proto.Marshal(&csi.NodeStageVolumeRequest{VolumeId: "v", Secrets: map[string]string{"k": "p\xe4ss"}})
	must.ErrorContains(t, err, "UTF-8")

	for _, tc := range []struct {
		name string
		set  func(r *VolumeRequest)
		want string
	}{
		{"secret value not UTF-8", func(r *VolumeRequest) { r.Secrets = map[string]string{"password": canary + "p\xe4ss"} },
			`secrets: a value is not valid UTF-8 (neither key nor value is shown: they may be secret): the CSI spec sends secrets as strings; encode binary secrets (as base64, say) the way the plugin documents`},
		{"secret key with a space", func(r *VolumeRequest) { r.Secrets = map[string]string{"pass word": canary} },
			`secrets: a key holds a character other than letters, digits, '-', '_' or '.', which the CSI spec allows in secret keys (the key is not shown: it may be secret)`},
		{"secret key with a slash", func(r *VolumeRequest) { r.Secrets = map[string]string{"tls/key": canary} },
			`secrets: a key holds a character other than letters, digits, '-', '_' or '.', which the CSI spec allows in secret keys (the key is not shown: it may be secret)`},
		{"secret key not ASCII", func(r *VolumeRequest) { r.Secrets = map[string]string{"mot-de-passé": canary} },
			`secrets: a key holds a character other than letters, digits, '-', '_' or '.', which the CSI spec allows in secret keys (the key is not shown: it may be secret)`},
		{"context value not UTF-8", func(r *VolumeRequest) { r.Context = map[string]string{"tier": "f\xffst"} },
			`context: key "tier" has a value that is not valid UTF-8: the plugin gets it as a string, which must be`},
		{"context key not UTF-8", func(r *VolumeRequest) { r.Context = map[string]string{"t\xffer": "fast"} },
			`context: a key is not valid UTF-8: the plugin gets it as a string, which must be`},
		{"mount flag not UTF-8", func(r *VolumeRequest) { r.MountFlags = []string{"noatime", "uid=\xff"} },
			`mount_options.mount_flags: flag 2 is not valid UTF-8: the plugin gets it as a string, which must be`},
		{"create parameter not UTF-8", func(r *VolumeRequest) { r.Create = &CreateRequest{Parameters: map[string]string{"type": "s\xffd"}} },
			`create.parameters: key "type" has a value that is not valid UTF-8: the plugin gets it as a string, which must be`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := req("data", "vol1", "/data")
			tc.set(&r)
			err := validate([]VolumeRequest{r})
			must.ErrorIs(t, err, ErrInvalid)
			must.EqError(t, err, `volume "data": `+tc.want)
			must.StrNotContains(t, err.Error(), canary)

			h := newHarness(t)
			_, err = h.m.Setup(context.Background(), "t", []VolumeRequest{r})
			must.ErrorContains(t, err, tc.want)
			must.SliceEmpty(t, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
		})
	}

	// What the spec allows passes: keys of its characters (as a
	// Kubernetes Secret's keys are), and any UTF-8 value, newlines and
	// all (a PEM key).
	r := req("data", "vol1", "/data")
	r.Secrets = map[string]string{"tls.key": "-----BEGIN KEY-----\nx\n", "user_name-2": "pässwörd", "A": ""}
	r.Context = map[string]string{"zone": "zürich"}
	must.NoError(t, validate([]VolumeRequest{r}))
}
