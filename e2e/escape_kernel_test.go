//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// 14. Reach the task's supervisor, and the descriptors the driver and the
// supervisor hold. The supervisor is the init of the task's PID namespace
// (pid 1 there), root with every capability, in the host's mount namespace:
// its /proc/1/root, /proc/1/fd and memory would be the host's. The task
// lists its own descriptors (anything but stdio is a leak: one open on a
// host file or directory is a way out of its root, reopened through
// /proc/self/fd/N), tries to open each for writing, and then goes for pid
// 1: its /proc entries, ptrace attach and seize, process_vm_readv of its
// text, kcmp, pidfd_open and pidfd_getfd of its descriptors 0 to 15, and
// SIGKILL and SIGSTOP (init of a namespace gets only the signals it
// handles; a supervisor that stopped or died would leave the task
// unreaped, and the job would never end). The numbers of the calls come
// from the test ($1...$5).
const escSupervisorScript = escTry + escWho + `perl -e '
$| = 1;
my ($ptrace, $vmread, $kcmp, $pidfd_open, $pidfd_getfd) = @ARGV;
sub res { my ($n, $r, $e) = @_; print "RESULT $n ", ($r < 0 ? "FAILED errno $e" : "OK $r"), "\n"; }
opendir(my $d, "/proc/self/fd") or die "opendir: $!";
my $dfd = fileno($d);
my @extra;
for my $fd (sort { $a <=> $b } grep { /^\d+$/ } readdir $d) {
  next if $fd == $dfd;
  my $l = readlink("/proc/self/fd/$fd") // "?";
  print "FD $fd -> $l\n";
  next if $fd <= 2;
  my $w = open(my $f, "+<", "/proc/self/fd/$fd") ? "writable" : "not writable: $!";
  push @extra, "$fd->$l ($w)";
}
closedir $d;
print "RESULT extra-fds ", (@extra ? "OK @extra" : "FAILED only stdio"), "\n";
for my $e ("exe", "root/etc/hostname", "cwd", "environ", "mem") {
  my $ok = open(my $f, "<", "/proc/1/$e");
  print "RESULT open-pid1-$e ", ($ok ? "OK" : "FAILED $!"), "\n";
}
my $l = readlink("/proc/1/root");
print "RESULT readlink-pid1-root ", (defined $l ? "OK $l" : "FAILED $!"), "\n";
res("ptrace-attach", syscall($ptrace + 0, 16, 1, 0, 0), $!+0);
res("ptrace-seize", syscall($ptrace + 0, 0x4206, 1, 0, 0), $!+0);
my $buf = "\0" x 16;
my $liov = pack("QQ", unpack("Q", pack("p", $buf)), 16);
my $riov = pack("QQ", 0x400000, 16);
res("process-vm-readv", syscall($vmread + 0, 1, $liov, 1, $riov, 1, 0), $!+0);
res("kcmp", syscall($kcmp + 0, 1, $$, 0, 0, 0), $!+0);
my $pfd = syscall($pidfd_open + 0, 1, 0);
print "pidfd_open(1): ", ($pfd < 0 ? "errno " . ($!+0) : "fd $pfd"), "\n";
my @got;
if ($pfd >= 0) {
  for my $n (0 .. 15) {
    my $r = syscall($pidfd_getfd + 0, $pfd, $n, 0);
    push @got, "$n->" . (readlink("/proc/self/fd/$r") // "?") if $r >= 0;
  }
}
print "RESULT pidfd-getfd ", (@got ? "OK @got" : "FAILED none of 0-15"), "\n";
' "$@"
kill -KILL 1 2>/dev/null; kill -STOP 1 2>/dev/null
echo "after signals: pid 1 is $(cat /proc/1/comm 2>&1)"
echo DONE
`

func escSupervisor(t *testing.T, e *escEnv, user string) {
	job := escRun(t, e.a, escJob{User: user, Script: escSupervisorScript, Args: []string{
		fmt.Sprint(unix.SYS_PTRACE), fmt.Sprint(unix.SYS_PROCESS_VM_READV), fmt.Sprint(unix.SYS_KCMP),
		fmt.Sprint(unix.SYS_PIDFD_OPEN), fmt.Sprint(unix.SYS_PIDFD_GETFD)}})
	// escFinished: the job ended, so the supervisor reaped its task.
	_, res := escFinished(t, e.a, job, "t")
	res.mustFail(t, "extra-fds", "open-pid1-exe", "open-pid1-root/etc/hostname", "open-pid1-cwd",
		"open-pid1-environ", "open-pid1-mem", "readlink-pid1-root", "ptrace-attach", "ptrace-seize",
		"process-vm-readv", "kcmp", "pidfd-getfd")
}

// 15. The kernel's interfaces a root task could leave its root through:
// open_by_handle_at (the "shocker" escape: a handle from name_to_handle_at
// on a chroot_env bind opens any inode of the host's file system with
// CAP_DAC_READ_SEARCH), mounting proc, sysfs, tmpfs, cgroup (v1's
// release_agent) and a bind of /, the chroot(2) escape (chroot into a
// subdirectory, then ".." to the real root: with CAP_SYS_CHROOT the task
// may call chroot), writing the host's kernel settings back with the
// value they hold (core_pattern, modprobe, uevent_helper, sysrq), and
// reading kernel memory and log (/proc/kcore, /dev/kmsg, /proc/kmsg). The
// chroot escape looks for a directory on the host that the task's root
// does not have ($6). The numbers of the calls come from the test.
const escKernelScript = escTry + escWho + `echo "caps: $(grep ^Cap /proc/self/status | tr '\n\t' '  ')"
perl -e '
$| = 1;
my ($n2h, $obh, $mount, $chroot, $hostdir) = @ARGV;
sub res { my ($n, $r, $e) = @_; print "RESULT $n ", ($r < 0 ? "FAILED errno $e" : "OK $r"), "\n"; }
my $h = pack("Li", 128, 0) . ("\0" x 128);
my $mid = "\0" x 4;
my ($etc, $mnt, $jail, $dot) = ("/etc", "/tmp/escape-mnt", "/tmp/escape-chroot", ".");
my $r = syscall($n2h + 0, -100, $etc, $h, $mid, 0);
print "name_to_handle_at(/etc): ", ($r < 0 ? "errno " . ($!+0) : "ok"), "\n";
if ($r >= 0) {
  open(my $m, "<", "/etc") or die "open /etc: $!";
  res("open-by-handle", syscall($obh + 0, fileno($m), $h, 0), $!+0);
} else {
  print "RESULT open-by-handle FAILED no handle\n";
}
mkdir $mnt;
for my $fs (["proc", "proc", 0], ["sysfs", "sysfs", 0], ["tmpfs", "tmpfs", 0], ["cgroup", "cgroup", 0], ["/", "", 4096 | 16384]) {
  my ($src, $type, $flags) = @$fs;
  my $n = "mount-" . ($type eq "" ? "bind-root" : $type);
  my $opts = $type eq "cgroup" ? "none,name=escape" : "";
  res($n, syscall($mount + 0, $src, $mnt, $type, $flags, $opts), $!+0);
}
for my $f ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/sys/kernel/uevent_helper", "/proc/sysrq-trigger") {
  my $v = "";
  if (open(my $in, "<", $f)) { local $/; $v = <$in> // ""; }
  $v = "\n" if $v eq "";
  my $n = "write-$f";
  if (open(my $out, ">", $f)) {
    my $ok = syswrite($out, $v);
    print "RESULT $n ", (defined $ok ? "OK wrote it back" : "FAILED write: $!"), "\n";
  } else { print "RESULT $n FAILED open: $!\n"; }
}
for my $f ("/proc/kcore", "/dev/kmsg", "/proc/kmsg") {
  my $buf;
  my $ok = open(my $in, "<", $f) && defined sysread($in, $buf, 16);
  print "RESULT read-$f ", ($ok ? "OK" : "FAILED $!"), "\n";
}
mkdir $jail;
if (opendir(my $keep, "/")) {
  if (syscall($chroot + 0, $jail) < 0) { print "RESULT chroot-escape FAILED chroot: $!\n"; }
  else {
    chdir("..") for 1 .. 64;
    syscall($chroot + 0, $dot);
    print "RESULT chroot-escape ", (-e $hostdir ? "OK $hostdir is there" : "FAILED no $hostdir"), "\n";
  }
}
' "$@"
echo DONE
`

func escKernel(t *testing.T, e *escEnv, user string) {
	// A directory the host has and the task's root does not: the
	// agent's data directory.
	hostDir := filepath.Join(e.a.Dir, "escape-chroot-"+escUniq())
	if err := os.Mkdir(hostDir, 0o755); err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() { escRemove(t, hostDir) })
	job := escRun(t, e.a, escJob{User: user, Script: escKernelScript, Args: []string{
		fmt.Sprint(unix.SYS_NAME_TO_HANDLE_AT), fmt.Sprint(unix.SYS_OPEN_BY_HANDLE_AT), fmt.Sprint(unix.SYS_MOUNT),
		fmt.Sprint(unix.SYS_CHROOT), hostDir}})
	al, res := escFinished(t, e.a, job, "t")
	var names []string
	for n := range res {
		names = append(names, n)
	}
	for _, want := range []string{"open-by-handle", "mount-proc", "mount-sysfs", "mount-tmpfs", "mount-cgroup",
		"mount-bind-root", "write-/proc/sys/kernel/core_pattern", "write-/proc/sys/kernel/modprobe",
		"write-/sys/kernel/uevent_helper", "write-/proc/sysrq-trigger", "read-/proc/kcore", "read-/dev/kmsg",
		"read-/proc/kmsg", "chroot-escape"} {
		res.mustFail(t, want)
	}
	if len(names) < 14 {
		t.Errorf("the attack reported %d steps, want 14: %s\n%s", len(names), strings.Join(names, " "), al.Describe())
	}
}
