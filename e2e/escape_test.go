//go:build e2e

package e2e

// The escape suite of the isolation issue: each attack runs as a
// non-privileged batch (or service) task of the csi driver, once with user
// unset and once as root (root with the default capabilities is the
// stronger attacker), and must fail. Each subtest checks the host, not
// only what the task says, and logs the task's output so that the reason
// is visible. The control case, a privileged CSI plugin task, must keep
// the powers the attacks are denied.
//
// The cases share one agent whose driver allows privileged tasks (the
// fixture plugin needs it, and an operator who runs CSI plugins sets it),
// and one fixture plugin for the cases with volumes. Each case cleans up
// what it made on the host (files, directories, cgroups, sleepers) and
// stops and purges its jobs, also when it fails.
//
// E2E_DRIVER=exec runs the attackers of the cases that need no CSI volume
// of their own on Nomad's exec driver instead (victims and plugins stay on
// the csi driver), as nobody, which checks that each case passes against
// isolation that works; the other cases and the root variants are skipped
// then.

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// escEnv is what the cases share.
type escEnv struct {
	a       *Agent
	fx      *VolFixture
	fixture string // the csi-fixture binary
}

func TestEscape(t *testing.T) {
	t.Parallel()
	fixture := csiBin(t, "csi-fixture")
	// join_user_namespace asks for pid_mode = "host", which the operator
	// must allow (TestEscapeHostPIDMode: refused by default).
	opts := AgentOptions{AllowPrivileged: true, Drivers: []string{DriverName}, DriverConfig: "allow_host_namespaces = true"}
	if testDriver != DriverName {
		opts.Drivers = append(opts.Drivers, testDriver)
	}
	a := StartAgent(t, opts)
	// Before the agent closes: workloads first, then the plugins, and
	// nothing left mounted or journaled.
	t.Cleanup(func() { volFinalCheck(t, a) })
	e := &escEnv{a: a, fx: a.StartVolFixture(t, "escape", VolFixtureOptions{}), fixture: fixture}

	users := []struct{ name, user string }{{"user_unset", ""}, {"user_root", "root"}}
	for _, at := range escAttacks {
		t.Run(at.name, func(t *testing.T) {
			t.Parallel()
			for _, u := range users {
				t.Run(u.name, func(t *testing.T) {
					if u.user == "root" && testDriver != DriverName {
						// With "user.checked_drivers" cleared, exec
						// still fails here: "unable to apply caps:
						// operation not permitted".
						t.Skipf("Nomad's %s driver refuses root (client user.denylist)", testDriver)
					}
					t.Parallel()
					at.run(t, e, u.user)
				})
			}
		})
	}
	t.Run("mknod_in_volume", func(t *testing.T) {
		requireCSI(t) // the volume workload runs on the csi driver
		t.Parallel()
		escMknodInVolume(t, e)
	})
	t.Run("privileged_plugin_keeps_its_powers", func(t *testing.T) {
		t.Parallel()
		escPrivilegedPlugin(t, e)
	})
}

// escAttacks are the attacks TestEscape runs as user unset and as root,
// and TestEscapeImage from a task whose root is an image.
var escAttacks = []struct {
	name string
	run  func(t *testing.T, e *escEnv, user string)
}{
	{"host_file_write", escHostWrite},
	{"mknod_block_device", escMknod},
	{"host_processes", escHostProcesses},
	{"driver_state_and_secrets", escReadState},
	{"read_only_volume_write", escReadOnlyVolume},
	{"spec_rewrite_then_alloc_exec", escSpecRewrite},
	{"leave_cgroup", escLeaveCgroup},
	{"destination_on_host", escDestination},
	{"destination_through_symlink", escSymlinkDestination},
	{"host_keyring", escKeyring},
	{"user_namespace", escUserNamespace},
	{"join_user_namespace", escJoinUserNamespace},
	{"host_binary_through_proc_exe", escExe},
	{"supervisor_and_descriptors", escSupervisor},
	{"kernel_interfaces", escKernel},
	{"log_rotation_symlink", escLogRotation},
	{"identity_token_symlink", escIdentityToken},
}

// escRun runs an attack job on the driver under test (unless the job
// names its driver) and stops and purges it when the test ends.
func escRun(t *testing.T, a *Agent, j escJob) Job {
	t.Helper()
	if j.Driver == "" {
		j.Driver = testDriver
		// The attackers of TestEscapeImage run from its image.
		if img, ok := escImages.Load(a); ok && j.Image == "" {
			j.Image = img.(string)
		}
	}
	job := a.RunJob(t, "escape-task", j.vars())
	t.Cleanup(func() { a.stopJobs([]string{job.ID}, escTimeout) })
	return job
}

// Each attack below is a shell script, run by escRun as the task "t" of
// e2e/jobs/escape-task.hcl with the test's arguments as $1..., that prints
// a "RESULT <step> OK|FAILED <why>" line for each step it tries (escTry)
// and DONE at its end; the Go function beside it sets the attack up on the
// host and checks the host afterwards.

// 1. Write files into /etc, /var/tmp and /root of the host: one
// "write:<path>" step per path given.
const escHostWriteScript = escTry + escWho + `put() { echo "written by a non-privileged task" > "$1"; }
for p in "$@"; do try "write:$p" put "$p"; done
echo DONE
`

func escHostWrite(t *testing.T, e *escEnv, user string) {
	u := escUniq()
	paths := []string{"/etc/escape-" + u, "/var/tmp/escape-" + u, "/root/escape-" + u}
	t.Cleanup(func() {
		for _, p := range paths {
			escRemove(t, p)
		}
	})
	job := escRun(t, e.a, escJob{User: user, Script: escHostWriteScript, Args: paths})
	_, res := escFinished(t, e.a, job, "t")
	for _, p := range paths {
		r, ok := res["write:"+p]
		if !ok {
			t.Errorf("the task did not try to write %s", p)
		}
		escMustNotExist(t, p, fmt.Sprintf("a task's write (it said ok=%v %s)", r.OK, r.Why))
	}
}

// 2. Make a node for a host block device in /tmp and read it; read the
// host's own node too. The device is a loop device the test attaches to a
// file that starts with a marker (the host's disk, /dev/vda, cannot be
// opened even by the host's root on these machines); the marker in the
// task's output means a read got through. The script makes the node
// (major $1, minor $2) as /tmp/escape-blk-$4, reads it, reads the host's
// node ($3), and removes its node (the test does when the task could not);
// a read prints the device's first printable bytes.
const escMknodScript = escTry + escWho + `readdev() {
  c=$(dd if="$1" bs=512 count=1 2>/dev/null | tr -cd '[:print:]')
  [ -n "$c" ] || { dd if="$1" of=/dev/null bs=512 count=1 2>&1 | head -1; return 1; }
  echo "first bytes: $c"
}
node=/tmp/escape-blk-$4
try mknod mknod "$node" b "$1" "$2"
try read-node readdev "$node"
try read-host-node readdev "$3"
rm -f "$node"
echo DONE
`

func escMknod(t *testing.T, e *escEnv, user string) {
	u := escUniq()
	marker := "ESCAPE-LOOP-" + u
	dev := escLoopDevice(t, marker)
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatalf("%v", err)
	}
	major, minor := unix.Major(st.Rdev), unix.Minor(st.Rdev)
	// Today the task's /tmp is the host's.
	t.Cleanup(func() { escRemove(t, "/tmp/escape-blk-"+u) })
	job := escRun(t, e.a, escJob{User: user, Script: escMknodScript,
		Args: []string{strconv.Itoa(int(major)), strconv.Itoa(int(minor)), dev, u}})
	al, res := escFinished(t, e.a, job, "t")
	t.Logf("block device %s (%d:%d); mknod said: OK=%v %s", dev, major, minor, res["mknod"].OK, res["mknod"].Why)
	res.mustFail(t, "read-node", "read-host-node")
	if out, _ := e.a.Nomad(escLogArgs(al.ID, false)...); strings.Contains(out, marker) {
		t.Errorf("ESCAPED: the task printed the device's content %q", marker)
	}
}

// 3. See and signal a host process; see the Nomad agent. The script gets
// the host sleeper's pid ($1, running "sleep 300.$2") and the agent's pid
// ($3): can it see them in /proc, or signal the sleeper? The pattern is
// built at run time so that the task's own argv does not match it.
const escHostProcessesScript = escTry + escWho + `pat="sleep 300.$2"
` + escSeen + `scan() {
  for f in /proc/[0-9]*/cmdline; do
    c=$(tr '\0' ' ' 2>/dev/null < "$f")
    case "$c" in *"$1"*) echo "$f: $c"; return 0 ;; esac
  done
  echo "none of $(ls -d /proc/[0-9]* | wc -l) processes in /proc runs $1"; return 1
}
try see-sleeper seen "$1" "$pat"
try scan-sleeper scan "$pat"
try see-agent seen "$3" nomad
try kill-0 kill -0 "$1"
try kill-term kill -TERM "$1"
echo "processes in /proc: $(ls -d /proc/[0-9]* | wc -l)"
echo DONE
`

func escHostProcesses(t *testing.T, e *escEnv, user string) {
	nonce := escUniq()
	s := escStartSleeper(t, nonce)
	agentPID := e.a.PID()
	job := escRun(t, e.a, escJob{User: user, Script: escHostProcessesScript,
		Args: []string{strconv.Itoa(s.PID), nonce, strconv.Itoa(agentPID)}})
	_, res := escFinished(t, e.a, job, "t")
	if alive, how := s.Alive(); !alive {
		t.Errorf("ESCAPED: the host sleeper pid %d is gone (%s)", s.PID, how)
	} else {
		t.Logf("contained: the host sleeper pid %d is still running", s.PID)
	}
	res.mustFail(t, "see-sleeper", "scan-sleeper", "see-agent", "kill-0", "kill-term")
}

// 4. Read the driver's root_dir and journal, and another allocation's
// secrets: list root_dir ($1), read its journal ($2), list the victim's
// secrets dir ($3) and read the secret in it ($4).
const escReadStateScript = escTry + escWho + `readfile() { c=$(cat "$1") && printf '%s' "$c" | tr -cd '[:print:]'; }
try list-root-dir ls -la "$1"
try read-journal readfile "$2"
try list-secrets-dir ls -la "$3"
try read-secret readfile "$4"
echo DONE
`

// escSecretHolderScript is the victim of attack 4, a service task with a
// CSI volume whose secrets block puts a second secret into the driver's
// journal: it keeps the secret $1 in its own secrets directory.
const escSecretHolderScript = `echo "$1" > "$NOMAD_SECRETS_DIR/escape-secret"
echo "secret written to $NOMAD_SECRETS_DIR/escape-secret"
exec sleep 3600
`

func escReadState(t *testing.T, e *escEnv, user string) {
	u := escUniq()
	secret, volSecret := "escape-secret-"+u, "escape-journal-secret-"+u
	vol := VolSpec{Name: "data", Plugin: e.fx.ID, ID: "escape-sec-" + u, Dest: "/escape-data",
		Create: true, CreateType: "dir", Secrets: map[string]string{"token": volSecret}}
	holder := escRun(t, e.a, escJob{Type: "service", Driver: DriverName, Script: escSecretHolderScript,
		Args: []string{secret}, Volumes: []VolSpec{vol}})
	hal := e.a.WaitAlloc(t, holder.ID, escTimeout, StatusRunning)
	e.a.WaitLogs(t, hal.ID, "t", "secret written", escTimeout)

	// The targets are real: the test, on the host, reads both secrets.
	secretsDir := filepath.Join(e.a.DataDir, "alloc", hal.ID, "t", "secrets")
	secretFile := filepath.Join(secretsDir, "escape-secret")
	journal := filepath.Join(e.a.DriverRoot, "journal", "journal.log")
	if b, err := os.ReadFile(secretFile); err != nil || !strings.Contains(string(b), secret) {
		// Seen when a spare supervisor's mount namespace predates the
		// secrets tmpfs Nomad mounts for the allocation (with / private
		// on the host): the task wrote below the tmpfs. The host's view
		// is what an attacker goes for; put the secret there.
		t.Logf("NOTE: the victim's secret is not in %s on the host (%v); host mount there: %v; in the victim task: %s",
			secretFile, err, mountInfo(secretsDir) != nil, escTaskMountAt(hal.ID, "t", secretsDir))
		if err := os.WriteFile(secretFile, []byte(secret+"\n"), 0o600); err != nil {
			t.Fatalf("%v", err)
		}
	}
	// The journal keeps a volume's secrets only while a call needs them
	// (they leave it about a second after the publish); the journal itself
	// must still be out of the task's reach.
	if _, err := os.Stat(journal); err != nil {
		t.Fatalf("no journal at %s on the host (%v): the attack would prove nothing", journal, err)
	}

	job := escRun(t, e.a, escJob{User: user, Script: escReadStateScript,
		Args: []string{e.a.DriverRoot, journal, secretsDir, secretFile}})
	al, res := escFinished(t, e.a, job, "t")
	res.mustFail(t, "list-root-dir", "read-journal", "list-secrets-dir", "read-secret")
	// What the task printed is on the host, in Nomad's log files.
	for _, stderr := range []bool{false, true} {
		out, _ := e.a.Nomad(escLogArgs(al.ID, stderr)...)
		for _, s := range []string{secret, volSecret} {
			if strings.Contains(out, s) {
				t.Errorf("ESCAPED: the task's output holds the secret %q", s)
			}
		}
	}
}

func escLogArgs(allocID string, stderr bool) []string {
	if stderr {
		return []string{"alloc", "logs", "-stderr", allocID, "t"}
	}
	return []string{"alloc", "logs", allocID, "t"}
}

// 5. Write into another task's read-only volume through the driver's
// publish and staging mounts and the plugin's backing directory: overwrite
// "file" and create "escape-new" in each path given.
const escReadOnlyVolumeScript = escTry + escWho + `put() { echo "overwritten by a non-privileged task" > "$1"; }
for p in "$@"; do
  try "overwrite:$p" put "$p/file"
  try "create:$p" put "$p/escape-new"
done
echo DONE
`

func escReadOnlyVolume(t *testing.T, e *escEnv, user string) {
	u := escUniq()
	name := "escape-ro-" + u
	// Create the volume, then put a file in it from the host.
	mk := e.a.RunVolJob(t, VolJob{Script: "echo created",
		Volumes: []VolSpec{{Name: "data", Plugin: e.fx.ID, ID: name, Dest: "/data", Create: true, CreateType: "dir"}}})
	t.Cleanup(func() { e.a.stopJobs([]string{mk.ID}, escTimeout) })
	e.a.WaitAlloc(t, mk.ID, volTimeout, StatusComplete)
	volID := e.fx.VolumeID(name)
	if volID == "" {
		t.Fatalf("the fixture has no volume named %s", name)
	}
	backing := filepath.Join(e.fx.StateDir, "volumes", volID)
	original := "original-" + u + "\n"
	if err := os.WriteFile(filepath.Join(backing, "file"), []byte(original), 0o644); err != nil {
		t.Fatalf("failed to seed the volume: %v", err)
	}

	reader := e.a.RunVolJob(t, VolJob{Type: "service", Script: volSleeper,
		Volumes: []VolSpec{{Name: "data", Plugin: e.fx.ID, ID: name, Dest: "/data", Access: "single-node-reader-only", ReadOnly: true}}})
	t.Cleanup(func() { e.a.stopJobs([]string{reader.ID}, escTimeout) })
	ral := e.a.WaitAlloc(t, reader.ID, volTimeout, StatusRunning)
	e.a.WaitLogs(t, ral.ID, "t", "started", escTimeout)

	// The reader's mounts of the volume, from the host's mountinfo: the
	// mounts under root_dir/mnt whose root is the volume's directory.
	table, err := mounter.New().List()
	if err != nil {
		t.Fatalf("%v", err)
	}
	var targets []string
	for _, mp := range table {
		if mounter.PathWithin(mp.Path, filepath.Join(e.a.DriverRoot, "mnt")) && strings.HasSuffix(mp.Root, "/volumes/"+volID) {
			targets = append(targets, mp.Path)
			t.Logf("volume mount on the host: %s (options %v)", mp.Path, mp.Options)
		}
	}
	if len(targets) == 0 {
		var all []string
		for _, mp := range table {
			if mounter.PathWithin(mp.Path, filepath.Join(e.a.DriverRoot, "mnt")) {
				all = append(all, mp.Path+" root="+mp.Root)
			}
		}
		t.Fatalf("no mount of volume %s under %s/mnt on the host; mounts there:\n%s", volID, e.a.DriverRoot, strings.Join(all, "\n"))
	}
	targets = append(targets, backing)

	job := escRun(t, e.a, escJob{User: user, Script: escReadOnlyVolumeScript, Args: targets})
	_, res := escFinished(t, e.a, job, "t")
	for _, p := range targets {
		res.mustFail(t, "overwrite:"+p, "create:"+p)
	}
	// The host's view of the volume.
	if b, err := os.ReadFile(filepath.Join(backing, "file")); err != nil || string(b) != original {
		t.Errorf("ESCAPED: the volume's file changed: %q (%v), want %q", b, err, original)
	}
	escMustNotExist(t, filepath.Join(backing, "escape-new"), "a new file in the read-only volume")
}

var escSelfLine = regexp.MustCompile(`SELF CapEff=([0-9a-f]+) uid=(\d+)`)

// 6. Rewrite the driver's spec.json files to say privileged, then see what
// "nomad alloc exec" runs with. The service task prints its own
// capabilities (for comparison), rewrites every spec.json under
// root_dir/tasks ($1) it can reach to say privileged, as root, and waits
// for the test to run "nomad alloc exec" in it.
const escSpecRewriteScript = escTry + escWho + `echo "SELF CapEff=$(awk '/^CapEff/ {print $2}' /proc/self/status) uid=$(id -u)"
rewrite() {
  new=$(sed -e 's/"privileged":false/"privileged":true/' -e 's/"user":"[^"]*"/"user":"root"/' "$1") || return 1
  printf '%s' "$new" > "$1" || return 1
  grep -o '"privileged":[a-z]*' "$1"
}
found=0
for f in $(find "$1/tasks" -name spec.json 2>/dev/null); do
  found=1
  try "rewrite:$f" rewrite "$f"
done
[ "$found" = 1 ] || echo "RESULT find-spec FAILED no spec.json under $1/tasks: $(ls "$1/tasks" 2>&1 | head -1)"
echo DONE
exec sleep 3600
`

func escSpecRewrite(t *testing.T, e *escEnv, user string) {
	job := escRun(t, e.a, escJob{Type: "service", User: user, Script: escSpecRewriteScript, Args: []string{e.a.DriverRoot}})
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusRunning)
	e.a.WaitLogs(t, al.ID, "t", "DONE", escTimeout)
	out := escLogs(t, e.a, al.ID, "t")
	m := escSelfLine.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("the task did not print its own capabilities")
	}
	selfCaps, _ := strconv.ParseUint(m[1], 16, 64)
	selfUID := m[2]
	for n, r := range escParse(out) {
		t.Logf("%s: OK=%v %s", n, r.OK, r.Why)
	}
	escLogSpecs(t, e.a, al.ID)

	capOut, err := e.a.AllocExec(al.ID, "t", "grep", "CapEff", "/proc/self/status")
	if err != nil {
		t.Fatalf("nomad alloc exec grep CapEff failed after the rewrite: %v: %s", err, capOut)
	}
	uidOut, err := e.a.AllocExec(al.ID, "t", "id", "-u")
	if err != nil {
		t.Fatalf("nomad alloc exec id -u failed after the rewrite: %v: %s", err, uidOut)
	}
	f := strings.Fields(capOut)
	if len(f) != 2 {
		t.Fatalf("unexpected alloc exec output: %q", capOut)
	}
	execCaps, err := strconv.ParseUint(f[1], 16, 64)
	if err != nil {
		t.Fatalf("unexpected alloc exec output: %q", capOut)
	}
	execUID := strings.TrimSpace(uidOut)
	t.Logf("task: CapEff=%016x uid=%s; alloc exec: CapEff=%016x uid=%s", selfCaps, selfUID, execCaps, execUID)
	kernel, host := escFullCaps(t)
	if execCaps == kernel || execCaps == host || execCaps == 0x3fffffffff || execCaps == 0x1ffffffffff {
		t.Errorf("ESCAPED: nomad alloc exec ran with every capability (%016x)", execCaps)
	}
	if execCaps != selfCaps {
		t.Errorf("ESCAPED: nomad alloc exec ran with CapEff %016x, the task has %016x", execCaps, selfCaps)
	}
	if execUID != selfUID {
		t.Errorf("ESCAPED: nomad alloc exec ran as uid %s, the task as uid %s", execUID, selfUID)
	}
}

// escLogSpecs logs what the host's spec.json of an allocation says now.
func escLogSpecs(t *testing.T, a *Agent, allocID string) {
	files, _ := filepath.Glob(filepath.Join(a.DriverRoot, "tasks", "*", "spec.json"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil || !strings.Contains(string(b), allocID) {
			continue
		}
		priv := regexp.MustCompile(`"privileged":[a-z]+`).FindString(string(b))
		usr := regexp.MustCompile(`"user":"[^"]*"`).FindString(string(b))
		t.Logf("host %s: %s %s", f, priv, usr)
	}
}

// 7. Leave the task's cgroup (the task and a background child), and see
// whether the child outlives the job. The service task and a background
// child each write their pid into the root of every hierarchy under
// /sys/fs/cgroup (tasks, cgroup.procs) and into a new group
// escape-$2-<task|child> made there; the child then becomes
// "sleep 301.$1", which must not outlive the job.
const escLeaveCgroupScript = escTry + escWho + `putpid() { echo "$1" > "$2"; }
leave() {
  for h in /sys/fs/cgroup/*; do
    [ -d "$h" ] && [ ! -L "$h" ] || continue
    for f in tasks cgroup.procs; do
      [ -e "$h/$f" ] && try "$2:write:$h/$f" putpid "$1" "$h/$f"
    done
    if try "$2:mkdir:$h/escape-$3-$2" mkdir "$h/escape-$3-$2"; then
      try "$2:move:$h/escape-$3-$2" putpid "$1" "$h/escape-$3-$2/cgroup.procs"
    fi
  done
}
(
  read -r pid _ < /proc/self/stat
  leave "$pid" child "$2"
  echo "child cgroups: $(tr '\n' ' ' < /proc/self/cgroup)"
  echo DONE-child
  exec sleep "301.$1"
) &
sleep 1
leave "$$" task "$2"
echo "task cgroups: $(tr '\n' ' ' < /proc/self/cgroup)"
echo DONE-task
wait
`

func escLeaveCgroup(t *testing.T, e *escEnv, user string) {
	nonce, u := escUniq(), escUniq()
	argv := []string{"sleep", "301." + nonce}
	var allocID string
	t.Cleanup(func() {
		victims := map[int]bool{}
		for _, pid := range escProcsRunning(argv...) {
			victims[pid] = true
		}
		if allocID != "" {
			for _, pid := range TaskPIDs(allocID, "t") {
				victims[pid] = true
			}
		}
		for _, d := range escCgroupDirs("escape-" + u + "-*") {
			for _, pid := range escCgroupPIDs(d) {
				victims[pid] = true
			}
		}
		for pid := range victims {
			t.Logf("killing leftover pid %d: %s", pid, escCmdline(pid))
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		for _, d := range escCgroupDirs("escape-" + u + "-*") {
			var err error
			for range 20 {
				if err = unix.Rmdir(d); err == nil || os.IsNotExist(err) {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil && !os.IsNotExist(err) {
				t.Errorf("failed to remove the cgroup %s the attack made: %v", d, err)
			} else {
				t.Logf("removed the cgroup %s the attack made", d)
			}
		}
	})
	job := escRun(t, e.a, escJob{Type: "service", User: user, Script: escLeaveCgroupScript, Args: []string{nonce, u}})
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusRunning)
	allocID = al.ID
	e.a.WaitLogs(t, al.ID, "t", "DONE-child", escTimeout)
	e.a.WaitLogs(t, al.ID, "t", "DONE-task", escTimeout)
	out := escLogs(t, e.a, al.ID, "t")
	res := escParse(out)
	ok := 0
	for _, r := range res {
		if r.OK {
			ok++
		}
	}
	t.Logf("%d of the %d cgroup writes and mkdirs succeeded (see the RESULT lines)", ok, len(res))
	running := escProcsRunning(argv...)
	if len(running) == 0 {
		t.Fatalf("the task's child %q is not running on the host: the attack proves nothing", strings.Join(argv, " "))
	}
	for _, pid := range running {
		t.Logf("before the stop: pid %d in %s", pid, escCgroupOf(pid))
	}
	if made := escCgroupDirs("escape-" + u + "-*"); len(made) > 0 {
		t.Errorf("ESCAPED: the task made %d cgroups on the host: %s", len(made), strings.Join(made, " "))
	}

	e.a.VolStopAndWait(t, job.ID, escTimeout)
	var left []int
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if left = escProcsRunning(argv...); len(left) == 0 {
			break
		}
	}
	for _, pid := range left {
		t.Errorf("ESCAPED: %q pid %d outlived the job, in %s", strings.Join(argv, " "), pid, escCgroupOf(pid))
	}
	if pids := TaskPIDs(al.ID, "t"); len(pids) > 0 {
		t.Errorf("ESCAPED: processes of the task outlived the job: %v", pids)
	}
	if len(left) == 0 {
		t.Logf("contained: no process of the task outlived the job")
	}
}

// 8a. A volume destination below an existing host directory
// (/srv/escape-<unique>/data, $1) must be made on the task's own root,
// never on the host. The job needs the csi driver for its volume.
const escDestinationScript = `echo uid=$(id -u); ls -ld "$1"; echo DONE`

func escDestination(t *testing.T, e *escEnv, user string) {
	requireCSI(t)
	u := escUniq()
	dir := "/srv/escape-" + u
	dest := filepath.Join(dir, "data")
	t.Cleanup(func() {
		if m, _ := MountsUnder(dir); len(m) > 0 {
			t.Errorf("mounts under %s on the host: %v", dir, m)
			return
		}
		escRemove(t, dest)
		escRemove(t, dir)
	})
	vol := VolSpec{Name: "data", Plugin: e.fx.ID, ID: "escape-dst-" + u, Dest: dest, Create: true, CreateType: "dir"}
	job := escRun(t, e.a, escJob{Driver: DriverName, User: user, Script: escDestinationScript,
		Args: []string{dest}, Volumes: []VolSpec{vol}})
	escFinished(t, e.a, job, "t")
	escMustNotExist(t, dir, "volume destination "+dest)
}

// 8b. A volume destination through a symlink a prestart task made in the
// shared alloc dir: the prestart task points ${NOMAD_ALLOC_DIR}/data/link
// at /etc; the main task's volume destination goes through that link,
// written from the task's environment so that it holds whether the alloc
// dir is the host path or /alloc. The target must be made inside the
// task's root, never as /etc/escape-<unique> on the host. Both tasks run
// on the csi driver, whose volume the main task needs.
const (
	escSymlinkPrestart = `mkdir -p "$NOMAD_ALLOC_DIR/data" && ln -sfn /etc "$NOMAD_ALLOC_DIR/data/link" && ls -l "$NOMAD_ALLOC_DIR/data"`
	escSymlinkScript   = `echo uid=$(id -u); ls -ld "$NOMAD_ALLOC_DIR/data/link" "$NOMAD_ALLOC_DIR/data/link/"*escape* ; echo DONE`
)

func escSymlinkDestination(t *testing.T, e *escEnv, user string) {
	requireCSI(t)
	u := escUniq()
	hostTarget := "/etc/escape-" + u
	t.Cleanup(func() { escRemove(t, hostTarget) })
	vol := VolSpec{Name: "data", Plugin: e.fx.ID, ID: "escape-lnk-" + u, Dest: "${NOMAD_ALLOC_DIR}/data/link/escape-" + u,
		Create: true, CreateType: "dir", Interpolate: true}
	job := escRun(t, e.a, escJob{Driver: DriverName, User: user, Prestart: escSymlinkPrestart,
		Script: escSymlinkScript, Volumes: []VolSpec{vol}})
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
	if !strings.Contains(escLogs(t, e.a, al.ID, "prestart"), "link -> /etc") {
		t.Fatalf("the prestart task did not make the link: the attack did not run:\n%s", al.Describe())
	}
	if !strings.Contains(escLogs(t, e.a, al.ID, "t"), "DONE") {
		t.Logf("the main task did not run to its end (refused?):\n%s", al.Describe())
	}
	escMustNotExist(t, hostTarget, "volume destination through "+"${NOMAD_ALLOC_DIR}/data/link -> /etc")
}

// The control: a privileged CSI plugin task keeps the host's powers. Its
// script (e2e/jobs/escape-privileged-plugin.hcl runs it) writes a file into
// the test's directory ($1), looks for the host sleeper (pid $2,
// "sleep 300.$3") in /proc, prints its capabilities, and then runs the
// fixture plugin ($4, state in $5) so that it is a real plugin.
const escPrivilegedPluginScript = escTry + `put() { echo "written by a privileged plugin task" > "$1"; }
` + escSeen + `echo "SELF CapEff=$(awk '/^CapEff/ {print $2}' /proc/self/status) uid=$(id -u)"
try write-host "put" "$1/written-by-plugin"
try see-sleeper seen "$2" "sleep 300.$3"
echo DONE
exec "$4" --state-dir "$5" --node-id e2e-escape-node
`

func escPrivilegedPlugin(t *testing.T, e *escEnv) {
	requireCSI(t)
	u := escUniq()
	nonce := escUniq()
	s := escStartSleeper(t, nonce)
	hostDir := t.TempDir()
	stateDir := filepath.Join(e.a.Dir, "fx-priv-"+u)
	pluginID := "escape-priv-" + u
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		t.Fatalf("%v", err)
	}
	job := e.a.RunJob(t, "escape-privileged-plugin", map[string]string{
		"PluginID": pluginID,
		"Script":   volHCLString(escPrivilegedPluginScript),
		"Args":     volHCLList([]string{hostDir, strconv.Itoa(s.PID), nonce, e.fixture, stateDir}),
	})
	t.Cleanup(func() { e.a.stopJobs([]string{job.ID}, escTimeout) })
	al := e.a.WaitAlloc(t, job.ID, escTimeout, StatusRunning)
	e.a.WaitLogs(t, al.ID, "plugin", "DONE", escTimeout)
	out := escLogs(t, e.a, al.ID, "plugin")
	e.a.WaitVolPluginHealthy(t, pluginID, time.Minute)
	res := escParse(out)
	for _, n := range []string{"write-host", "see-sleeper"} {
		if r := res[n]; !r.OK {
			t.Errorf("%s: the privileged plugin task lost this power: %s", n, r.Why)
		}
	}
	if b, err := os.ReadFile(filepath.Join(hostDir, "written-by-plugin")); err != nil {
		t.Errorf("the privileged plugin task's file is not on the host: %v", err)
	} else {
		t.Logf("the privileged plugin task wrote %s on the host: %q", filepath.Join(hostDir, "written-by-plugin"), strings.TrimSpace(string(b)))
	}
	m := escSelfLine.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("the plugin task did not print its capabilities")
	}
	caps, _ := strconv.ParseUint(m[1], 16, 64)
	if kernel, host := escFullCaps(t); caps != host {
		t.Errorf("the privileged plugin task has CapEff %016x, want the host root's full set %016x (the kernel's: %016x)", caps, host, kernel)
	} else {
		t.Logf("the privileged plugin task has the host root's full set %016x", caps)
	}
	if alive, how := s.Alive(); !alive {
		t.Errorf("the host sleeper is gone (%s)", how)
	}
}
