// Package safetext is the one cleaner of text that a job, a plugin or a
// task chose (paths, commands, user names, volume fields, plugin messages,
// the errors that wrap them) on its way to a terminal: a task event in
// `nomad alloc status`, the agent's log, an error Nomad shows, the
// operator CLI. Every character that is not printable (C0 and C1 controls
// such as ESC or the 8-bit CSI U+009B, DEL, bidirectional overrides and
// isolates, zero-width and other format characters, line and paragraph
// separators, bytes that are not UTF-8) is written as a Go escape (\n,
// \x1b, \u202e), so such text can neither drive the terminal it is printed
// on (move the cursor, clear the screen, set the window title, fake
// colours) nor hide or reorder what is shown around it.
//
// Clean leaves printable text as it is and is idempotent: text that was
// cleaned, or quoted with %q, passes unchanged.
//
// It depends on the standard library only, so every layer may use it.
package safetext

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Clean returns s with every character that is not printable written as a
// Go escape: \n, \r and \t; \xNN for other ASCII controls and DEL and for
// each byte that is not part of valid UTF-8; \uNNNN or \UNNNNNNNN for any
// other rune unicode.IsPrint rejects. Printable text is returned as it is.
func Clean(s string) string {
	if IsClean(s) {
		return s
	}
	return bounded(s, -1)
}

// Bounded is Clean of at most limit runes of s; what is cut is counted as
// "... (N more bytes)".
func Bounded(s string, limit int) string {
	if limit < 0 {
		limit = 0
	}
	if IsClean(s) && utf8.RuneCountInString(s) <= limit {
		return s
	}
	return bounded(s, limit)
}

// IsClean reports whether Clean would leave s as it is.
func IsClean(s string) bool {
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return false
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && n == 1) || !IsPrint(r) {
			return false
		}
		i += n
	}
	return true
}

// IsPrint reports whether Clean keeps the rune r as it is: for writers
// that must escape in another syntax (JSON's \uXXXX), with the same rule.
func IsPrint(r rune) bool {
	if r < utf8.RuneSelf {
		return r >= 0x20 && r != 0x7f
	}
	return unicode.IsPrint(r)
}

// bounded escapes s, keeping at most limit runes (no bound when negative).
func bounded(s string, limit int) string {
	var b strings.Builder
	b.Grow(len(s) + 16)
	n := 0
	for i := 0; i < len(s); {
		if limit >= 0 && n == limit {
			fmt.Fprintf(&b, "... (%d more bytes)", len(s)-i)
			break
		}
		n++
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		case unicode.IsPrint(r):
			b.WriteRune(r)
		case r < 0x10000:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			fmt.Fprintf(&b, `\U%08x`, r)
		}
		i += size
	}
	return b.String()
}

// Error returns err with its message cleaned. An error whose message is
// clean is returned as it is (so that a sentinel compared with == or
// errors.Is still matches); any other is replaced by one that carries the
// cleaned message and unwraps to err. Errors that say whether they are
// recoverable (Nomad's structs.Recoverable) keep saying so. Error(nil) is
// nil.
func Error(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if IsClean(msg) {
		return err
	}
	c := &cleaned{msg: Clean(msg), err: err}
	var rec recoverable
	if errors.As(err, &rec) {
		return &cleanedRecoverable{cleaned: c, recoverable: rec.IsRecoverable()}
	}
	return c
}

// recoverable is Nomad's structs.Recoverable, by shape.
type recoverable interface {
	error
	IsRecoverable() bool
}

type cleaned struct {
	msg string
	err error
}

func (c *cleaned) Error() string { return c.msg }
func (c *cleaned) Unwrap() error { return c.err }

type cleanedRecoverable struct {
	*cleaned
	recoverable bool
}

func (c *cleanedRecoverable) IsRecoverable() bool { return c.recoverable }
