package safetext

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/shoenig/test/must"
)

// Hostile is what the tests of every layer feed through a field a job,
// task or plugin controls: ESC sequences (CSI clear screen, SGR colour,
// OSC window title ended by BEL and by ST), a lone ESC, the 8-bit CSI and
// OSC (C1), DEL, a bidi override and isolate, a zero-width space, the line
// separator, a NUL, a newline and a byte that is not UTF-8.
const Hostile = "x\x1b[2J\x1b[31mRED\x1b]0;pwned\x07\x1b]2;t\x1b\\\x1b\u009b2J\u009d0;t\u009c\x7f\u202egnp.exe\u2066\u200b\u2028\x00\n\xff"

func TestClean(t *testing.T) {
	cases := []struct{ in, want string }{
		{"plain text: /a/b c", "plain text: /a/b c"},
		{"", ""},
		{"tab\there", `tab\there`},
		{"line\nnext\r", `line\nnext\r`},
		{"\x1b[31mred", `\x1b[31mred`},
		{"\x1b]0;title\x07", `\x1b]0;title\x07`},
		{"del\x7f nul\x00", `del\x7f nul\x00`},
		{"c1 csi\u009b osc\u009d st\u009c", `c1 csi\u009b osc\u009d st\u009c`},
		{"bidi\u202e iso\u2066 lrm\u200e", `bidi\u202e iso\u2066 lrm\u200e`},
		{"zw\u200b ls\u2028 nbsp\u00a0", `zw\u200b ls\u2028 nbsp\u00a0`},
		{"bad\xffutf8", `bad\xffutf8`},
		{"ok \uFFFD", "ok \uFFFD"},
		{"tag\U000E0041", `tag\U000e0041`},
		{"ünïcödé 日本 ✓", "ünïcödé 日本 ✓"},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%q", tc.in), func(t *testing.T) {
			got := Clean(tc.in)
			must.Eq(t, tc.want, got)
			must.True(t, IsClean(got))
			must.Eq(t, got, Clean(got), must.Sprint("not idempotent"))
			must.Eq(t, tc.in == tc.want, IsClean(tc.in))
		})
	}
}

// Every byte of the hostile sample that a terminal acts on is escaped,
// and so is anything a quoted (%q) or cleaned text holds after a round.
func TestClean_Hostile(t *testing.T) {
	got := Clean(Hostile)
	must.True(t, IsClean(got))
	for _, r := range []rune{0x1b, 0x07, 0x9b, 0x9c, 0x9d, 0x7f, 0x202e, 0x2066, 0x200b, 0x2028, 0, '\n'} {
		must.StrNotContains(t, got, string(r))
	}
	must.True(t, utf8.ValidString(got))
	must.True(t, IsClean(fmt.Sprintf("%q", Hostile)), must.Sprint("Go's quoting must be clean already"))
}

func TestBounded(t *testing.T) {
	long := strings.Repeat("é", 20)
	must.Eq(t, long, Bounded(long, 20))
	must.Eq(t, strings.Repeat("é", 10)+"... (20 more bytes)", Bounded(long, 10))
	must.Eq(t, `a\x1bb`, Bounded("a\x1bb", 3))
	must.Eq(t, `a\x1b... (1 more bytes)`, Bounded("a\x1bb", 2))
	must.Eq(t, "... (3 more bytes)", Bounded("abc", 0))
}

type rec struct{ error }

func (rec) IsRecoverable() bool { return true }

func TestError(t *testing.T) {
	must.NoError(t, Error(nil))

	sentinel := errors.New("task not found for given id")
	must.True(t, Error(sentinel) == sentinel, must.Sprint("a clean error must be returned as it is"))

	inner := errors.New("stat /x\x1b]0;t\x07: no such file or directory")
	wrapped := fmt.Errorf("failed to start: %w", inner)
	got := Error(wrapped)
	must.Eq(t, `failed to start: stat /x\x1b]0;t\x07: no such file or directory`, got.Error())
	must.True(t, errors.Is(got, inner))

	r := Error(rec{errors.New("bad\x1b")})
	must.Eq(t, `bad\x1b`, r.Error())
	rr, ok := r.(interface{ IsRecoverable() bool })
	must.True(t, ok)
	must.True(t, rr.IsRecoverable())
}
