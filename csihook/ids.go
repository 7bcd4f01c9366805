package csihook

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// ShortHash is 16 hex characters of the SHA-256 of parts joined by NUL: the
// name of a directory or file kept for an ID that may hold slashes. The
// driver names its task directories by it too, so it must never change.
func ShortHash(parts ...string) string {
	sum := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(sum[:8])
}
