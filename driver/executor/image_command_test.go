package executor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/go-hclog"
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

// An image's working directory that is a symlink of the image is where the
// symlink leads inside the root, made there if missing (as Docker makes a
// WORKDIR through the image's symlinks); a working directory that is a
// file of the image fails the start naming it.
func TestImageRoot_WorkingDirThroughSymlink_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, `echo "cwd=$(pwd -P)"`, false)
	top := tt.spec.Image.Layers[1]
	must.NoError(t, os.Symlink("/opt/app", filepath.Join(top, "app")))
	tt.spec.Dir = "/app/sub"
	got := runLines(t, tt)
	must.Eq(t, "/opt/app/sub", got["cwd"])
	_, err := os.Stat(filepath.Join(tt.spec.StateDir, "upper/opt/app/sub"))
	must.NoError(t, err, must.Sprint("the working directory is made in the task's writable layer"))

	tt = imageSpec(t, `echo "cwd=$(pwd -P)"`, false)
	tt.spec.Dir = "/etc/name"
	p, err := Start(hclog.NewNullLogger(), tt.spec, nil)
	if err == nil {
		_ = p.Kill()
		_ = p.Destroy()
		t.Fatal("a task started in a working directory that is a file")
	}
	must.StrContains(t, err.Error(), `working directory "/etc/name"`)
}

// With readonly_rootfs, a working directory the image lacks is still made
// (in the memory the read-only root keeps), and nothing goes to disk.
func TestImageRoot_ReadOnlyWorkingDir_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := imageSpec(t, `echo "cwd=$(pwd -P)"; if touch x 2>/dev/null; then echo w=writable; else echo w=read-only; fi`, false)
	tt.spec.Image.ReadOnly = true
	tt.spec.Dir = "/srv/app"
	got := runLines(t, tt)
	must.Eq(t, "/srv/app", got["cwd"])
	must.Eq(t, "read-only", got["w"])
	_, err := os.Stat(filepath.Join(tt.spec.StateDir, "upper"))
	must.True(t, os.IsNotExist(err), must.Sprint("a read-only root has no writable layer on disk"))
}
