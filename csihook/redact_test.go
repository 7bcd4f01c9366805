package csihook

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// A plugin's message that echoes a secret with %q, %+q or as JSON has it
// redacted as surely as one that prints it as it is.
func TestRedact_echoedForms(t *testing.T) {
	core := "SECRETCORE"
	for _, secret := range []string{
		`q"` + core + "\\x\té",
		core + "<&>",
		core + "\n\x01",
		core,
	} {
		j, _ := json.Marshal(secret)
		for _, msg := range []string{
			"plain " + secret,
			fmt.Sprintf("quoted %q", secret),
			fmt.Sprintf("ascii %+q", secret),
			fmt.Sprintf("json %s", j),
			fmt.Sprintf("request {secrets:map[token:%s]}", secret),
		} {
			got := cleanBounded(msg, MaxErrorMessage, map[string]string{"token": secret})
			must.False(t, strings.Contains(got, core), must.Sprintf("secret %q shows in %q (from %q)", secret, got, msg))
			must.StrContains(t, got, redacted)
		}
	}
}
