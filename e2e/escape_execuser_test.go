//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// TestEscapeExecUser: a task running as nobody with a volume of its own at
// /etc rewrites its passwd and group files so that nobody is uid 0 and in
// group 0. Whatever "nomad alloc exec" (or a script check of the job) runs
// in it must still run as the user the task was started as, resolved on
// the host: uid 65534 with no capabilities, never root with exec's
// default set. A restart of the task (a new start, with the rewritten
// volume mounted again) must not take the task's files either.
func TestEscapeExecUser(t *testing.T) {
	t.Parallel()
	a := volAgent(t, false)
	fx := a.StartVolFixture(t, "execuser", VolFixtureOptions{})
	u := escUniq()

	// The fixture's dir volumes are 0777: nobody writes its /etc. Each
	// start counts itself in the volume, so that the test can tell the
	// restarted task from the first.
	script := `
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:0:0:nobody:/:/bin/sh\n' > /etc/passwd || exit 1
printf 'root:x:0:nobody\ndisk:x:6:nobody\nnogroup:x:65534:\n' > /etc/group || exit 1
n=$(cat /etc/starts 2>/dev/null || echo 0); n=$((n+1)); echo "$n" > /etc/starts
echo "start=$n uid=$(id -u) gid=$(id -g) $(grep CapEff /proc/self/status | tr -d '\t')"
exec sleep 3600
`
	job := a.RunVolJob(t, VolJob{Type: "service", User: "nobody", Script: script,
		Volumes: []VolSpec{{Name: "etc", Plugin: fx.ID, ID: "escape-execuser-" + u, Dest: "/etc", Create: true, CreateType: "dir"}}})
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, escTimeout) })
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)

	for start := 1; start <= 2; start++ {
		if start == 2 {
			// Nomad starts the task again (a user restart does not count
			// against the group's restart policy of no attempts).
			out, err := a.Nomad("alloc", "restart", al.ID, "t")
			must.NoError(t, err, must.Sprintf("nomad alloc restart: %s", out))
		}
		logs := a.WaitLogs(t, al.ID, "t", fmt.Sprintf("start=%d ", start), 60*time.Second)
		line := lineWith(logs, fmt.Sprintf("start=%d ", start))
		t.Logf("the task's own start %d: %s", start, line)
		// The task itself runs as nobody, with no capabilities, on every
		// start: the start resolves the user on the host too.
		must.StrContains(t, line, "uid=65534 gid=65534 CapEff:0000000000000000",
			must.Sprintf("start %d of the task took its user from its own /etc:\n%s", start, logs))

		// The premise: the task's /etc is the volume, and it says nobody
		// is root.
		passwd, err := a.AllocExec(al.ID, "t", "cat", "/etc/passwd")
		must.NoError(t, err, must.Sprintf("nomad alloc exec cat /etc/passwd: %s", passwd))
		must.StrContains(t, passwd, "nobody:x:0:0:", must.Sprint("the task's /etc/passwd was not rewritten: the case proves nothing"))

		out, err := a.AllocExec(al.ID, "t", "/bin/sh", "-c",
			`echo "uid=$(id -u)"; echo "gid=$(id -g)"; echo "groups=$(id -G)"; grep CapEff /proc/self/status | tr -d '\t' | tr : =`)
		must.NoError(t, err, must.Sprintf("nomad alloc exec: %s", out))
		t.Logf("alloc exec after start %d:\n%s", start, strings.TrimSpace(out))
		got := map[string]string{}
		for _, l := range strings.Split(out, "\n") {
			if k, v, ok := strings.Cut(strings.TrimSpace(l), "="); ok {
				got[k] = v
			}
		}
		must.Eq(t, "65534", got["uid"], must.Sprintf("ESCAPED: alloc exec took its uid from the task's own /etc/passwd:\n%s", out))
		must.Eq(t, "65534", got["gid"], must.Sprintf("ESCAPED: alloc exec took its gid from the task's own /etc/passwd:\n%s", out))
		must.Eq(t, "65534", got["groups"], must.Sprintf("ESCAPED: alloc exec took its groups from the task's own /etc/group:\n%s", out))
		must.Eq(t, "0000000000000000", got["CapEff"], must.Sprintf("ESCAPED: alloc exec in a nobody task holds capabilities:\n%s", out))
	}
}

// TestEscapeExecUserImage: an image task runs as the image's user "app"
// (uid 1000 in the image's /etc/passwd), and its root's /etc is writable
// to it. It rewrites its own /etc/passwd and /etc/group so that app is
// uid 0. "nomad alloc exec" must run as uid 1000 still: the credential was
// resolved from the image's layers when the task started, never from the
// task's root.
func TestEscapeExecUserImage(t *testing.T) {
	requireCSI(t)
	t.Parallel()
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("test needs a static /bin/busybox (Debian's busybox-static) to make an image")
	}
	base, err := imagebuild.HostFiles(map[string]string{"/bin/busybox": "/bin/busybox"})
	must.NoError(t, err)
	for _, applet := range []string{"sh", "id", "cat", "grep", "tr", "printf", "sleep", "echo"} {
		base = append(base, imagebuild.Symlink("bin/"+applet, "busybox"))
	}
	base = append(base,
		imagebuild.Dir("tmp", 0o1777),
		imagebuild.Dir("etc", 0o777),
		imagebuild.File("etc/passwd", []byte("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/:/bin/sh\n"), 0o666),
		imagebuild.File("etc/group", []byte("root:x:0:\napp:x:1000:\n"), 0o666))
	l0, err := imagebuild.Layer(base...)
	must.NoError(t, err)
	img, err := imagebuild.Build(imagebuild.Spec{Env: []string{"PATH=/bin"}}, l0)
	must.NoError(t, err)
	dirs := newImageDirs(t)
	layout := filepath.Join(dirs.images, "layout")
	must.NoError(t, imagebuild.WriteLayout(layout, "app", img))
	a := StartAgent(t, dirs.agentOptions(AgentOptions{Drivers: []string{DriverName}}))

	script := `
printf 'root:x:0:0::/root:/bin/sh\napp:x:0:0::/:/bin/sh\n' > /etc/passwd || exit 1
printf 'root:x:0:app\napp:x:0:\n' > /etc/group || exit 1
echo "start uid=$(id -u) gid=$(id -g) $(grep CapEff /proc/self/status | tr -d '\t')"
exec sleep 3600
`
	job := escRun(t, a, escJob{Type: "service", Driver: DriverName, User: "app", Image: "oci:" + layout + ":app", Script: script})
	al := a.WaitAlloc(t, job.ID, escTimeout, StatusRunning)
	line := lineWith(a.WaitLogs(t, al.ID, "t", "start uid=", 60*time.Second), "start uid=")
	t.Logf("the task: %s", line)
	must.StrContains(t, line, "uid=1000 gid=1000 CapEff:0000000000000000")

	passwd, err := a.AllocExec(al.ID, "t", "cat", "/etc/passwd")
	must.NoError(t, err, must.Sprintf("nomad alloc exec cat /etc/passwd: %s", passwd))
	must.StrContains(t, passwd, "app:x:0:0:", must.Sprint("the task's /etc/passwd was not rewritten: the case proves nothing"))

	out, err := a.AllocExec(al.ID, "t", "/bin/sh", "-c", `echo "uid=$(id -u) gid=$(id -g) groups=$(id -G) $(grep CapEff /proc/self/status | tr -d '\t')"`)
	must.NoError(t, err, must.Sprintf("nomad alloc exec: %s", out))
	t.Logf("alloc exec: %s", strings.TrimSpace(out))
	must.StrContains(t, out, "uid=1000 gid=1000 groups=1000 CapEff:0000000000000000",
		must.Sprintf("ESCAPED: alloc exec in an image task took its user from the task's own /etc:\n%s", out))
}
