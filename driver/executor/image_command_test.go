package executor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
)

// A command with a slash but no leading one is relative to the working
// directory, as execve and Docker take it: democratic-csi's image runs
// ENTRYPOINT ["bin/democratic-csi"] from WORKDIR /home/csi/app. A bare
// name is looked up in the task's PATH (the image's), inside the image.
func TestImageRoot_RelativeCommand_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, privileged := range []bool{false, true} {
		name := "isolated"
		if privileged {
			name = "privileged"
		}
		t.Run(name, func(t *testing.T) {
			for _, tc := range []struct {
				command string
				env     string
			}{
				{"bin/plugin", "PATH=/bin"},
				{"./bin/plugin", "PATH=/bin"},
				{"plugin", "PATH=/bin:/home/csi/app/bin"},
			} {
				tt := imageSpec(t, "", privileged)
				app := filepath.Join(tt.spec.Image.Layers[1], "home/csi/app/bin")
				must.NoError(t, os.MkdirAll(app, 0o755))
				must.NoError(t, os.WriteFile(filepath.Join(app, "plugin"), []byte("#!/bin/sh\necho \"cwd=$(pwd)\"\necho \"arg=$1\"\n"), 0o755))
				tt.spec.Command, tt.spec.Args = tc.command, []string{"--csi-mode=node"}
				tt.spec.Dir = "/home/csi/app"
				tt.spec.Env = []string{tc.env}
				got := runLines(t, tt)
				must.Eq(t, "/home/csi/app", got["cwd"], must.Sprint(tc.command))
				must.Eq(t, "--csi-mode=node", got["arg"], must.Sprint(tc.command))
			}
		})
	}
}
