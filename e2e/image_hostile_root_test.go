//go:build e2e

package e2e

import (
	"archive/tar"
	"os"
	"path/filepath"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// What an image's own setuid files, file capabilities and device nodes
// give a task that is not privileged: nothing. The store keeps them as the
// image has them (a privileged plugin needs them); the task's root is
// nosuid and nodev, the task runs with no_new_privs, and the device filter
// stands behind nodev.
func TestImageHostileContent(t *testing.T) {
	dirs := newImageDirs(t)
	perl, err := os.ReadFile("/usr/bin/perl")
	must.NoError(t, err)
	suid := imagebuild.File("usr/local/bin/suidperl", perl, 0o4755)
	// security.capability v2: every capability effective and permitted.
	allCaps := string([]byte{0x01, 0x00, 0x00, 0x02, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0})
	capped := imagebuild.File("usr/local/bin/capperl", perl, 0o755)
	capped.Header.PAXRecords = map[string]string{"SCHILY.xattr.security.capability": allCaps}
	hostile, err := imagebuild.Layer(
		imagebuild.Dir("usr/local/bin", 0o755), suid, capped,
		imagebuild.CharDevice("mem", 1, 1),
		imagebuild.Entry{Header: blockDevice("disk", 7, 0)},
	)
	must.NoError(t, err)
	img, err := mutate.AppendLayers(toolsImage(t), hostile)
	must.NoError(t, err)
	layout := filepath.Join(dirs.images, "hostile")
	must.NoError(t, imagebuild.WriteLayout(layout, "1", v1.Image(img)))
	a := StartAgent(t, dirs.agentOptions(AgentOptions{Drivers: []string{DriverName}}))

	script := `echo "suid=$(/usr/local/bin/suidperl -e 'print $>')"
echo "caps=$(/usr/local/bin/capperl -e 'open(F, "/proc/self/status"); for (<F>) { print $1 if /^CapEff:\s+(\S+)/ }')"
if head -c 1 /mem >/dev/null 2>&1; then echo mem=read; else echo mem=refused; fi
if head -c 1 /disk >/dev/null 2>&1; then echo disk=read; else echo disk=refused; fi`
	for _, user := range []string{"", "root"} {
		job := a.RunJob(t, "image_task", map[string]string{"Type": "batch", "Count": "1", "Image": "oci:" + layout + ":1",
			"Script": volHCLString(script), "User": user, "ReadOnly": ""})
		t.Cleanup(func() { a.stopJobs([]string{job.ID}, time.Minute) })
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusComplete)
		out := escLogs(t, a, al.ID, "t")
		t.Logf("user=%q: %s", user, out)
		if user == "" {
			must.StrContains(t, out, "suid=65534")
			must.StrContains(t, out, "caps=0000000000000000")
		}
		must.StrContains(t, out, "mem=refused")
		must.StrContains(t, out, "disk=refused")
		must.StrNotContains(t, out, "caps=000001ffffffffff")
		must.StrNotContains(t, out, "caps=000000ffffffffff")
	}
}

func blockDevice(name string, major, minor int64) tar.Header {
	return tar.Header{Typeflag: tar.TypeBlock, Name: name, Mode: 0o666, Devmajor: major, Devminor: minor, ModTime: time.Unix(1700000000, 0)}
}
