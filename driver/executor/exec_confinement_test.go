package executor

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// execConfinementScript prints, as "key=value" lines, what a process of a
// task runs with: its namespaces, the capability, no_new_privs, seccomp
// and id lines of its status, each cgroup hierarchy it is in, its limits,
// its oom_score_adj, the descriptors the shell itself holds, and its
// session and controlling terminal (fields 6 and 7 of its stat), with its
// own pid to compare the session with.
const execConfinementScript = `
for n in mnt pid ipc net uts cgroup user; do echo "ns_$n=$(readlink /proc/self/ns/$n)"; done
while IFS= read -r line; do
	case "$line" in
	Cap*|NoNewPrivs*|Seccomp:*|Uid*|Gid*|Groups*) k=${line%%:*}; v=${line#*:}; echo "status_$k=$(echo $v)";;
	esac
done < /proc/self/status
while IFS= read -r line; do
	h=${line#*:}; h=${h%%:*}; echo "cgroup_[$(echo "$h" | tr = _)]=${line##*:}"
done < /proc/self/cgroup
i=0
while IFS= read -r line; do i=$((i+1)); echo "limit_$i=$(echo $line)"; done < /proc/self/limits
echo "oom_score_adj=$(cat /proc/self/oom_score_adj)"
fds=; for f in /proc/$$/fd/*; do fds="$fds ${f##*/}"; done; echo "fds=$fds"
set -- $(sed 's/.*) //' /proc/$$/stat)
echo "pid=$$"
echo "sid=$4"
echo "tty_nr=$5"
`

// hostView is what execConfinementScript prints for pid, read from the
// host: the keys that must be the same for the task's main process and a
// command exec'd into it.
func hostView(t *testing.T, pid int) map[string]string {
	t.Helper()
	got := map[string]string{}
	for _, n := range []string{"mnt", "pid", "ipc", "net", "uts", "cgroup", "user"} {
		l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, n))
		must.NoError(t, err)
		got["ns_"+n] = l
	}
	for _, line := range strings.Split(readFile(t, fmt.Sprintf("/proc/%d/status", pid)), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		if strings.HasPrefix(k, "Cap") || k == "NoNewPrivs" || k == "Seccomp" || k == "Uid" || k == "Gid" || k == "Groups" {
			got["status_"+k] = strings.Join(strings.Fields(v), " ")
		}
	}
	for _, line := range strings.Split(strings.TrimSpace(readFile(t, fmt.Sprintf("/proc/%d/cgroup", pid))), "\n") {
		parts := strings.SplitN(line, ":", 3)
		must.Eq(t, 3, len(parts), must.Sprintf("cgroup line %q", line))
		got["cgroup_["+strings.ReplaceAll(parts[1], "=", "_")+"]"] = parts[2]
	}
	for i, line := range strings.Split(strings.TrimSpace(readFile(t, fmt.Sprintf("/proc/%d/limits", pid))), "\n") {
		got[fmt.Sprintf("limit_%d", i+1)] = strings.Join(strings.Fields(line), " ")
	}
	got["oom_score_adj"] = strings.TrimSpace(readFile(t, fmt.Sprintf("/proc/%d/oom_score_adj", pid)))
	return got
}

// A command run with `nomad alloc exec` in a task that is not privileged
// runs confined exactly as the task's own process: in each of its
// namespaces, with its capability sets (bounding and ambient too),
// no_new_privs and a seccomp filter, as its user and groups, in its cgroup
// in every hierarchy, with its limits and oom_score_adj; it holds no
// descriptor but its stdio, and it is in a session of its own with no
// controlling terminal, as the task is: never in the driver's, whose
// terminal (an agent started from a shell has one) it could otherwise open
// as /dev/tty, which the task's /dev and device filter let through, to
// read what the operator types and write to their screen.
func TestProcess_Exec_SameConfinementAsTask_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, user := range []string{"root", "nobody"} {
		t.Run(user, func(t *testing.T) {
			tt := isolatedSpec(t, "exec sleep 100")
			tt.spec.User = user
			// On cgroup v1, a group in every hierarchy the driver limits;
			// on v2 (one hierarchy) the limits its controllers there take
			// (the devices' filter is a BPF program; a hybrid host's v2
			// hierarchy may have no other controller).
			tt.spec.Limits = cgroups.Limits{Devices: append([]cgroups.DeviceRule(nil), cgroups.DefaultDevices...)}
			if _, err := os.Stat("/sys/fs/cgroup/pids"); err == nil {
				tt.spec.Limits.MemoryBytes, tt.spec.Limits.CPUShares = 256<<20, 100
				tt.spec.Limits.CpusetCpus, tt.spec.Limits.PidsMax = "0", 64
			}
			if user == "nobody" {
				// The ambient set of a task of another user.
				tt.spec.AmbientCapabilities = []string{"NET_BIND_SERVICE"}
			}
			p := startTest(t, tt)
			want := hostView(t, p.Pid())

			var stdout, stderr bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", execConfinementScript}, Stdout: &stdout, Stderr: &stderr})
			must.NoError(t, err)
			must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
			got := outputLines(stdout.String())
			t.Log(got)

			for k, v := range want {
				must.Eq(t, v, got[k], must.Sprintf("%s of the exec'd command differs from the task's (task: %q, exec: %q)", k, v, got[k]))
			}
			// Sanity: the task is confined in the first place.
			must.Eq(t, "1", want["status_NoNewPrivs"])
			must.Eq(t, "2", want["status_Seccomp"])
			hostPID, err := os.Readlink("/proc/self/ns/pid")
			must.NoError(t, err)
			must.NotEq(t, hostPID, want["ns_pid"])

			// The shell's stdio and the directory its glob read them from.
			must.Eq(t, "0 1 2 3", strings.TrimSpace(got["fds"]), must.Sprint("the exec'd command holds descriptors beyond its stdio"))
			must.Eq(t, got["pid"], got["sid"], must.Sprint("the exec'd command is not the leader of a session of its own (a session outside the task's PID namespace reads 0)"))
			must.Eq(t, "0", got["tty_nr"], must.Sprint("the exec'd command has a controlling terminal"))
		})
	}
}

// envExecTerminal makes TestProcess_Exec_NoDriverTerminal_Root run its
// inner part: in a process whose controlling terminal is a pty the outer
// part holds.
const envExecTerminal = "EXECUTOR_TEST_EXEC_TERMINAL"

// A command exec'd into a task cannot reach the driver's controlling
// terminal. A driver started under an agent run from a shell has one,
// and a command run with `nomad alloc exec` (or a script check) is one of
// the task's binaries, which a hostile task chose: in the driver's session,
// it would open /dev/tty (in the task's /dev, let through by its device
// filter, and open to any user: it is the caller's own terminal) and read
// what the operator types there, or write to their screen. The test runs
// its inner part in a process of its own, made the leader of a session
// whose controlling terminal is a pty this test holds.
func TestProcess_Exec_NoDriverTerminal_Root(t *testing.T) {
	requireTaskRoot(t)
	if os.Getenv(envExecTerminal) != "" {
		execNoDriverTerminal(t)
		return
	}
	ptmx, tty, err := pty.Open()
	must.NoError(t, err)
	defer ptmx.Close()
	var out bytes.Buffer
	cmd := exec.Command("/proc/self/exe", "-test.run=^TestProcess_Exec_NoDriverTerminal_Root$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), envExecTerminal+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	must.NoError(t, cmd.Start())
	_ = tty.Close()
	// The inner test's cgroups, should it be killed before it cleans up.
	t.Cleanup(func() {
		cleanupCgroup(t, fmt.Sprintf("nomad-driver-csi-executor-test-%d", cmd.Process.Pid), "task-1")
	})
	// What reaches the terminal is read, so that no write to it blocks.
	screen := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(ptmx)
		screen <- string(b)
	}()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		err = <-done
	}
	t.Log(out.String())
	must.NoError(t, err, must.Sprintf("the inner test failed:\n%s", out.String()))
	must.StrContains(t, out.String(), "--- PASS: TestProcess_Exec_NoDriverTerminal_Root")
	_ = ptmx.Close()
	select {
	case s := <-screen:
		must.StrNotContains(t, s, "from-the-task", must.Sprint("the exec'd command wrote to the driver's terminal"))
	case <-time.After(10 * time.Second):
	}
}

// execNoDriverTerminal is the inner part of
// TestProcess_Exec_NoDriverTerminal_Root.
func execNoDriverTerminal(t *testing.T) {
	f, err := os.OpenFile("/dev/tty", os.O_RDWR, 0)
	must.NoError(t, err, must.Sprint("the inner test has no controlling terminal to protect"))
	_ = f.Close()

	tt := isolatedSpec(t, "exec sleep 100")
	tt.spec.User = "nobody"
	tt.spec.Limits.Devices = append([]cgroups.DeviceRule(nil), cgroups.DefaultDevices...)
	p := startTest(t, tt)
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c",
		`if (echo from-the-task > /dev/tty) 2>/dev/null; then echo tty=opened; else echo tty=refused; fi`},
		Stdout: &stdout, Stderr: &stderr})
	must.NoError(t, err)
	must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
	must.Eq(t, "refused", outputLines(stdout.String())["tty"], must.Sprint("the exec'd command opened the driver's controlling terminal"))
}
