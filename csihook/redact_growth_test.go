package csihook

import (
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// A job's secrets that are pieces of the redaction marker itself never
// make redaction rewrite the markers it already wrote: each rewrite put
// new markers in the old ones, so a few dozen such secrets (the job
// chooses its secrets) grew a short plugin message exponentially, to
// gigabytes, and took the driver's memory. Markers stay whole and the
// result stays about the size of the message.
func TestRedact_markerPiecesDoNotGrow(t *testing.T) {
	secrets := map[string]string{"token": "volume"}
	n := 0
	for i := 0; i < len(redacted); i++ {
		for j := i + 1; j <= len(redacted) && j-i < len("volume"); j++ {
			secrets[fmt.Sprintf("k%d", n)] = redacted[i:j]
			n++
		}
	}
	msg := `volume "vol-1" not found on node`
	got := redact(msg, secrets)
	must.LessEq(t, len(msg)*len(redacted), len(got), must.Sprintf("redacted message grew to %d bytes", len(got)))
	must.StrNotContains(t, got, "volume")
	must.StrContains(t, got, redacted)
}

// Secrets that overlap in the message are removed whole: none of either
// shows.
func TestRedact_overlappingSecrets(t *testing.T) {
	got := redact("xx ABCDEF yy", map[string]string{"a": "ABCD", "b": "CDEF"})
	must.Eq(t, "xx "+redacted+" yy", got)
}

// A one-letter secret is redacted wherever it is, the markers written for
// it are never redacted again, and adjacent secrets make one marker.
func TestRedact_shortSecret(t *testing.T) {
	got := redact("stage failed", map[string]string{"a": "e", "b": "d"})
	must.Eq(t, "stag"+redacted+" fail"+redacted, got)
	must.False(t, strings.Contains(strings.ReplaceAll(got, redacted, ""), "e"))
}

// coverAll finds every occurrence, overlapping ones too.
func TestCoverAll(t *testing.T) {
	for _, tc := range []struct{ s, v, want string }{
		{"aaa", "aa", "xxx"},
		{"abababx", "abab", "xxxxxx."},
		{"aabaab", "aab", "xxxxxx"},
		{"xyz", "q", "..."},
		{"ab", "abc", ".."},
		{"cabcab", "ab", ".xx.xx"},
	} {
		covered := make([]bool, len(tc.s))
		found := coverAll(tc.s, tc.v, covered)
		var b strings.Builder
		for _, c := range covered {
			if c {
				b.WriteByte('x')
			} else {
				b.WriteByte('.')
			}
		}
		must.Eq(t, tc.want, b.String(), must.Sprintf("%q in %q", tc.v, tc.s))
		must.Eq(t, strings.Contains(tc.s, tc.v), found)
	}
}

// A long secret that repeats itself, in a long message that repeats it
// too, is found in time linear in the message: a search from each
// match's next byte compared the whole secret at every byte.
func BenchmarkRedact_periodic(b *testing.B) {
	secret := strings.Repeat("a", 64<<10)
	msg := strings.Repeat("a", 1<<20)
	for b.Loop() {
		_ = redact(msg, map[string]string{"k": secret})
	}
}

// A secret a plugin writes percent-encoded in a URL, or octal-escaped in
// protobuf's C text format, is redacted too.
func TestRedact_urlAndOctalForms(t *testing.T) {
	core := "SECRETCORE"
	for _, secret := range []string{core + "/ab+c d", core + "é\"x", "wJalr/" + core + "+EXAMPLEKEY"} {
		for _, msg := range []string{
			"mount s3://AKIA:" + url.QueryEscape(secret) + "@bucket failed",
			"GET /v1/" + url.PathEscape(secret) + " 403",
			"mount s3://AKIA:" + strings.ReplaceAll(url.QueryEscape(secret), "+", "%20") + "@bucket failed",
			`request { secrets { key: "token" value: "` + cEscape(secret) + `" } }`,
		} {
			got := cleanBounded(msg, MaxErrorMessage, map[string]string{"token": secret})
			must.StrNotContains(t, got, core, must.Sprintf("from %q", msg))
			must.StrContains(t, got, redacted)
		}
	}
	must.Eq(t, `SECRETCORE\303\251\"x`, cEscape(core+"é\"x"))
}
