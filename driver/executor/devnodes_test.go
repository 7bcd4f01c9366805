package executor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// The device nodes of a task's /dev are the host's own (bound, not made):
// a task running as root, with CHOWN and FOWNER, must not change their
// mode, owner or times, which are the host's /dev/null's (mode 000 there
// would break every program on the node). The task sets each to what it
// is already, so that the host is left as it was even when the change
// goes through; the device still works.
func TestIsolation_DevNodesNotTheHostsToChange_Root(t *testing.T) {
	requireTaskRoot(t)
	got := runLines(t, isolatedSpec(t, `
for n in null zero full random urandom tty; do
  [ -e /dev/$n ] || continue
  mode=$(stat -c %a /dev/$n)
  if chmod "$mode" /dev/$n 2>/dev/null; then echo "chmod_$n=ok"; else echo "chmod_$n=failed"; fi
  if chown "$(stat -c %u:%g /dev/$n)" /dev/$n 2>/dev/null; then echo "chown_$n=ok"; else echo "chown_$n=failed"; fi
  if touch -c -r /dev/$n /dev/$n 2>/dev/null; then echo "touch_$n=ok"; else echo "touch_$n=failed"; fi
done
if echo x > /dev/null && head -c1 /dev/zero >/dev/null && ! echo x 2>/dev/null > /dev/full; then echo works=ok; fi
`))
	for _, n := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		for _, op := range []string{"chmod", "chown", "touch"} {
			if v, ok := got[op+"_"+n]; ok {
				must.Eq(t, "failed", v, must.Sprintf("a root task could %s the host's /dev/%s", op, n))
			}
		}
	}
	must.MapContainsKey(t, got, "chmod_null")
	must.Eq(t, "ok", got["works"])
}

// The same holds for the device nodes Nomad hands a task (its devices) and
// for a block-device volume that is not read-only: each is the host's node
// (the volume's, its plugin's bind of the host's /dev/loopN, say), and a
// root task that made it mode 0666 would give every user of the host the
// device. The nodes here are the test's own, of devices the task never
// opens.
func TestIsolation_HandedDeviceNodesNotTheHostsToChange_Root(t *testing.T) {
	requireTaskRoot(t)
	dir := t.TempDir()
	early, late := filepath.Join(dir, "early"), filepath.Join(dir, "late")
	must.NoError(t, unix.Mknod(early, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 7))))
	must.NoError(t, unix.Mknod(late, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 201))))
	tt := isolatedSpec(t, `
for n in nomad-dev xvdb; do
  if chmod 666 /dev/$n 2>/dev/null; then echo "chmod_$n=ok"; else echo "chmod_$n=failed"; fi
  if chown 65534 /dev/$n 2>/dev/null; then echo "chown_$n=ok"; else echo "chown_$n=failed"; fi
done`)
	tt.spec.Mounts = []Mount{{Source: early, Target: "/dev/nomad-dev"}}
	tt.spec.LateMounts = []Mount{{Target: "/dev/xvdb"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: late, Target: "/dev/xvdb", NoSuid: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	got := exitLines(t, tt, p)
	for _, n := range []string{"nomad-dev", "xvdb"} {
		must.Eq(t, "failed", got["chmod_"+n], must.Sprintf("a root task could chmod the host's node at /dev/%s", n))
		must.Eq(t, "failed", got["chown_"+n], must.Sprintf("a root task could chown the host's node at /dev/%s", n))
	}
	for _, f := range []string{early, late} {
		var st unix.Stat_t
		must.NoError(t, unix.Stat(f, &st))
		must.Eq(t, uint32(0o600), st.Mode&0o7777, must.Sprintf("the host's %s changed", f))
		must.Eq(t, uint32(0), st.Uid, must.Sprintf("the host's %s changed owner", f))
	}
}

// A block-device volume repaired in a running task (ReplaceMount) is the
// host's node as much as the first one was: read-only as a mount.
func TestReplaceMount_DeviceNodeNotTheHostsToChange_Root(t *testing.T) {
	requireTaskRoot(t)
	dir := t.TempDir()
	first, fresh := filepath.Join(dir, "first"), filepath.Join(dir, "fresh")
	must.NoError(t, unix.Mknod(first, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 201))))
	must.NoError(t, unix.Mknod(fresh, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 202))))
	tt := isolatedSpec(t, `
while [ "$(stat -c %T /dev/xvdb)" != ca ]; do sleep 0.05; done
if chmod 666 /dev/xvdb 2>/dev/null; then echo chmod=ok; else echo chmod=failed; fi
exec sleep 100`)
	tt.spec.LateMounts = []Mount{{Target: "/dev/xvdb"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: first, Target: "/dev/xvdb", NoSuid: true}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	_, err = p.ReplaceMount(fresh, "/dev/xvdb", false)
	must.NoError(t, err)
	waitFor(t, "the task to try its fresh node", func() bool { return strings.Contains(readFile(t, tt.stdout), "chmod=") })
	must.StrContains(t, readFile(t, tt.stdout), "chmod=failed", must.Sprint("a root task could chmod the host's node of its repaired volume"))
	var st unix.Stat_t
	must.NoError(t, unix.Stat(fresh, &st))
	must.Eq(t, uint32(0o600), st.Mode&0o7777, must.Sprint("the host's node changed"))
}

// The task's stdin, and its stdout and stderr when Nomad's logs are
// disabled, are /dev/null opened by the supervisor: reached through
// /proc/self/fd, they must not be the host's node to change either.
func TestIsolation_StdioNullNotTheHostsToChange_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/perl"); err != nil {
		t.Skip("test makes its calls with /usr/bin/perl, which this host lacks")
	}
	var st unix.Stat_t
	must.NoError(t, unix.Stat("/dev/null", &st))
	if st.Mode&0o7777 != 0o666 || st.Uid != 0 || st.Gid != 0 {
		t.Skipf("the task sets /dev/null to mode 0666 and root's, and this host's is %o, %d:%d", st.Mode&0o7777, st.Uid, st.Gid)
	}
	withEachStage(t, func(t *testing.T, supervisor string) {
		// Perl's own fds 0, 1 and 2, through /proc/self/fd, by the system
		// calls' own answers, each set to what it is: the host's /dev/null
		// is left as it was either way. The report goes to a volume's file
		// perl opens itself (a shell's redirection would move its fds).
		tt := isolatedSpec(t, `perl -e '
open(my $out, ">", "/vol/out") or die "open: $!";
for my $fd (0, 1, 2) {
  my $f = "/proc/self/fd/$fd";
  print $out "chmod_$fd=", (chmod(0666, $f) ? "ok" : "failed"), "\n";
  print $out "chown_$fd=", (chown(0, 0, $f) ? "ok" : "failed"), "\n";
}
my $n = sysread(STDIN, my $buf, 1);
print $out "stdin=$n\n";
print STDOUT "x\n" or die; print STDERR "y\n" or die;
'`)
		tt.spec.Supervisor = supervisor
		// Logs disabled: Nomad hands /dev/null.
		vol := t.TempDir()
		tt.spec.StdoutPath, tt.spec.StderrPath = "/dev/null", "/dev/null"
		p, err := startWithLateMount(tt, vol, "/vol")
		must.NoError(t, err)
		t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
		must.Eq(t, 0, waitExit(t, p).ExitCode)
		got := outputLines(readFile(t, filepath.Join(vol, "out")))
		t.Log(got)
		must.Eq(t, "0", got["stdin"])
		for _, fd := range []string{"0", "1", "2"} {
			must.Eq(t, "failed", got["chmod_"+fd], must.Sprintf("a root task could chmod the host's /dev/null through its fd %s", fd))
			must.Eq(t, "failed", got["chown_"+fd], must.Sprintf("a root task could chown the host's /dev/null through its fd %s", fd))
		}
	})
}

// A privileged task is not bound by the read-only device nodes above: it
// holds CAP_SYS_ADMIN in a mount namespace of its own and could remount
// them, and the operator granted it the host. Its block-device volume's
// node is bound as Nomad's devices are, writable, at start and when the
// volume is repaired, so that a privileged job that prepares its node
// (chown to the user of its database) works as before. The task sets each
// node to the mode it has.
func TestPrivileged_DeviceNodesAsHanded_Root(t *testing.T) {
	requireTaskRoot(t)
	dir, tgt := t.TempDir(), t.TempDir()
	early, first, fresh := filepath.Join(dir, "early"), filepath.Join(dir, "first"), filepath.Join(dir, "fresh")
	must.NoError(t, unix.Mknod(early, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 7))))
	must.NoError(t, unix.Mknod(first, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 201))))
	must.NoError(t, unix.Mknod(fresh, unix.S_IFBLK|0o600, int(unix.Mkdev(7, 202))))
	dev, vol := filepath.Join(tgt, "nomad-dev"), filepath.Join(tgt, "xvdb")
	tt := newTestSpec(t, "/bin/sh", "-c", `
try() { if chmod 600 "$2" 2>/dev/null; then echo "chmod_$1=ok"; else echo "chmod_$1=failed"; fi; }
try dev `+dev+`
try vol `+vol+`
while [ "$(stat -c %T `+vol+`)" != ca ]; do sleep 0.05; done
try repaired `+vol+`
exec sleep 100`)
	tt.spec.Mounts = []Mount{{Source: early, Target: dev}}
	tt.spec.LateMounts = []Mount{{Target: vol}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: first, Target: vol}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	waitFor(t, "the task to try its first nodes", func() bool { return strings.Contains(readFile(t, tt.stdout), "chmod_vol=") })
	_, err = p.ReplaceMount(fresh, vol, false)
	must.NoError(t, err)
	waitFor(t, "the task to try its fresh node", func() bool { return strings.Contains(readFile(t, tt.stdout), "chmod_repaired=") })
	got := outputLines(readFile(t, tt.stdout))
	t.Log(got)
	for _, n := range []string{"dev", "vol", "repaired"} {
		must.Eq(t, "ok", got["chmod_"+n], must.Sprintf("a privileged task could not chmod its %s node", n))
	}
}
