package executor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// envSelfExeProbe makes the test binary, run as a task's command named
// /proc/self/exe, try to change the file that link leads to (runSelfExeProbe).
const envSelfExeProbe = "EXECUTOR_TEST_SELF_EXE_PROBE"

// runSelfExeProbe prints what this process's /proc/self/exe is and whether
// it could be changed through it: "chmod=ok" or the errno of a chmod to its
// own mode (a change of nothing that needs the same right as any other
// mode), and "dev_ino" of the file for the test to compare with the host's.
func runSelfExeProbe() int {
	link, _ := os.Readlink("/proc/self/exe")
	fmt.Printf("exe=%s\n", link)
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/exe", &st); err != nil {
		fmt.Printf("stat=%v\n", err)
		return 1
	}
	fmt.Printf("dev_ino=%d:%d\n", st.Dev, st.Ino)
	if err := unix.Chmod("/proc/self/exe", st.Mode&0o7777); err != nil {
		fmt.Printf("chmod=%d\n", err.(unix.Errno))
	} else {
		fmt.Println("chmod=ok")
	}
	return 0
}

// A task that is not privileged never reaches the host's file of the
// driver's or the supervisor's binary through /proc/self/exe: the seccomp
// stage it starts from (the supervisor's binary) and the exec stage of
// nomad alloc exec (the driver's) run from a read-only clone of the
// binary's mount, so a command named /proc/self/exe runs that clone, and a
// root task that opens its /proc/<pid>/exe cannot chmod it (nor write it,
// chown it or set its attributes) on the host.
func TestIsolation_SelfExeSealed_Root(t *testing.T) {
	requireTaskRoot(t)
	self, err := os.Executable()
	must.NoError(t, err)
	var host unix.Stat_t
	must.NoError(t, unix.Stat(self, &host))
	want := fmt.Sprintf("%d:%d", host.Dev, host.Ino)
	erofs := fmt.Sprint(int(unix.EROFS))

	t.Run("seccomp stage", func(t *testing.T) {
		tt := isolatedSpec(t, "")
		tt.spec.User = "root"
		tt.spec.Command, tt.spec.Args = "/proc/self/exe", nil
		tt.spec.Env = append(tt.spec.Env, envSelfExeProbe+"=1")
		got := runLines(t, tt)
		must.Eq(t, want, got["dev_ino"], must.Sprint("the command is not the test binary: the probe proves nothing"))
		must.Eq(t, erofs, got["chmod"], must.Sprintf("a root task changed the host's binary %s through /proc/self/exe", self))
	})
	// A task that holds SYS_ADMIN gets no user namespace rules, but its
	// first program is still the stage run from the clone: were the
	// command exec'd straight from the supervisor's fork, /proc/self/exe
	// would be the supervisor's binary on the host's mount.
	t.Run("seccomp stage with SYS_ADMIN", func(t *testing.T) {
		tt := isolatedSpec(t, "")
		tt.spec.User = "root"
		tt.spec.Capabilities = append(append([]string{}, DefaultCapabilities...), "CAP_SYS_ADMIN")
		tt.spec.Command, tt.spec.Args = "/proc/self/exe", nil
		tt.spec.Env = append(tt.spec.Env, envSelfExeProbe+"=1")
		got := runLines(t, tt)
		must.Eq(t, want, got["dev_ino"], must.Sprint("the command is not the test binary: the probe proves nothing"))
		must.Eq(t, erofs, got["chmod"], must.Sprintf("a root task with SYS_ADMIN changed the host's binary %s through /proc/self/exe", self))
	})
	t.Run("alloc exec", func(t *testing.T) {
		tt := isolatedSpec(t, "exec sleep 100")
		tt.spec.User = "root"
		tt.spec.Env = append(tt.spec.Env, envSelfExeProbe+"=1")
		p := startTest(t, tt)
		var stdout, stderr bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		code, err := p.Exec(ctx, ExecOptions{Command: []string{"/proc/self/exe"}, Stdout: &stdout, Stderr: &stderr})
		must.NoError(t, err)
		must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
		got := outputLines(stdout.String())
		t.Log(got)
		must.Eq(t, want, got["dev_ino"], must.Sprint("the command is not the test binary: the probe proves nothing"))
		must.Eq(t, erofs, got["chmod"], must.Sprintf("a root command of alloc exec changed the host's binary %s through /proc/self/exe", self))
	})
}

// The seccomp stage that a task holding SYS_ADMIN now starts from adds no
// user namespace rules: such a task still makes one (unshare -U), and its
// command is under the launching thread's filter alone; one without
// SYS_ADMIN is refused.
func TestIsolation_StageSysAdminUserns_Root(t *testing.T) {
	requireTaskRoot(t)
	if _, err := os.Stat("/usr/bin/unshare"); err != nil {
		t.Skipf("test needs /usr/bin/unshare: %v", err)
	}
	script := `if /usr/bin/unshare -U true 2>/dev/null; then echo unshare=ok; else echo unshare=refused; fi
echo "filters=$(grep Seccomp_filters /proc/self/status | tr -d ' \t' | cut -d: -f2)"`
	withAdmin := append(append([]string{}, DefaultCapabilities...), "CAP_SYS_ADMIN")
	withEachStage(t, func(t *testing.T, supervisor string) {
		for _, tc := range []struct {
			name    string
			user    string
			caps    []string
			ambient []string
			unshare string
			filters string
		}{
			{"root default", "root", DefaultCapabilities, nil, "refused", "2"},
			{"root sys_admin", "root", withAdmin, nil, "ok", "1"},
			{"nobody default", "nobody", withAdmin, nil, "refused", "2"},
			{"nobody ambient sys_admin", "nobody", withAdmin, []string{"CAP_SYS_ADMIN"}, "ok", "1"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				tt := isolatedSpec(t, script)
				tt.spec.Supervisor = supervisor
				tt.spec.User = tc.user
				tt.spec.Capabilities = tc.caps
				tt.spec.AmbientCapabilities = tc.ambient
				got := runLines(t, tt)
				must.Eq(t, tc.unshare, got["unshare"])
				must.Eq(t, tc.filters, got["filters"])
			})
		}
	})
}
