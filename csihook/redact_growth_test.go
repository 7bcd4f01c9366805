package csihook

import (
	"fmt"
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
