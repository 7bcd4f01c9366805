package executor

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

func TestStart_ExitCodeAndOutput_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", "echo hi; echo oops >&2; exit 3")
	p := startTest(t, tt)
	must.Positive(t, p.Pid())

	st := waitExit(t, p)
	must.Eq(t, 3, st.ExitCode)
	must.Eq(t, 0, st.Signal)
	must.False(t, st.OOMKilled)
	must.Eq(t, "", st.Err)
	must.Eq(t, "hi\n", readFile(t, tt.stdout))
	must.Eq(t, "oops\n", readFile(t, tt.stderr))

	// Every caller sees the same status.
	st2 := waitExit(t, p)
	must.Eq(t, st, st2)

	// The spec holds the env: it must not be readable by others, and the
	// supervisor log must not show it.
	fi, err := os.Stat(filepath.Join(tt.spec.StateDir, wire.SpecFile))
	must.NoError(t, err)
	must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
	must.StrNotContains(t, readFile(t, filepath.Join(tt.spec.StateDir, wire.SupervisorLogFile)), "hunter2")

	must.True(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	must.NoError(t, p.Destroy())
	must.NoError(t, p.Destroy()) // idempotent
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	_, err = os.Stat(tt.spec.StateDir)
	must.True(t, os.IsNotExist(err))
}

func TestStart_RelativeCommandUsesTaskPath_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "env")
	p := startTest(t, tt)
	st := waitExit(t, p)
	must.Eq(t, 0, st.ExitCode)
	out := readFile(t, tt.stdout)
	// Exactly the task's env, and the working directory is Dir.
	must.Eq(t, strings.Join(tt.spec.Env, "\n")+"\n", out)
}

func TestProcess_Signals_Root(t *testing.T) {
	requireTaskRoot(t)

	t.Run("signal kills", func(t *testing.T) {
		tt := newTestSpec(t, "sleep", "100")
		p := startTest(t, tt)
		must.NoError(t, p.Signal(syscall.SIGUSR1))
		st := waitExit(t, p)
		must.Eq(t, int(syscall.SIGUSR1), st.Signal)
		must.Eq(t, 128+int(syscall.SIGUSR1), st.ExitCode)
		// Signalling an exited task is not an error.
		must.NoError(t, p.Signal(syscall.SIGTERM))
	})

	t.Run("shutdown kills after grace", func(t *testing.T) {
		tt := newTestSpec(t, "/bin/sh", "-c", `trap "" TERM; echo ready; while :; do sleep 0.05; done`)
		p := startTest(t, tt)
		waitFor(t, "trap to be set", func() bool { return readFile(t, tt.stdout) == "ready\n" })
		begin := time.Now()
		must.NoError(t, p.Shutdown(syscall.SIGTERM, 500*time.Millisecond))
		took := time.Since(begin)
		must.GreaterEq(t, 500*time.Millisecond, took)
		must.Less(t, 10*time.Second, took)
		st := waitExit(t, p)
		must.Eq(t, int(syscall.SIGKILL), st.Signal)
	})

	// An image's STOPSIGNAL may be SIGSTOP (or a signal the task
	// ignores): the task freezes, and the kill after grace still ends it,
	// its children too.
	t.Run("shutdown with SIGSTOP kills after grace", func(t *testing.T) {
		tt := newTestSpec(t, "/bin/sh", "-c", `sleep 100 & echo ready; while :; do sleep 0.05; done`)
		p := startTest(t, tt)
		waitFor(t, "the child to start", func() bool { return readFile(t, tt.stdout) == "ready\n" })
		must.NoError(t, p.Shutdown(syscall.SIGSTOP, 200*time.Millisecond))
		st := waitExit(t, p)
		must.Eq(t, int(syscall.SIGKILL), st.Signal)
		must.Eq(t, 0, len(processesMentioning(t, tt.spec.TaskID)))
	})

	t.Run("shutdown returns early when the task obeys", func(t *testing.T) {
		tt := newTestSpec(t, "sleep", "100")
		p := startTest(t, tt)
		begin := time.Now()
		must.NoError(t, p.Shutdown(syscall.SIGTERM, 20*time.Second))
		must.Less(t, 5*time.Second, time.Since(begin))
		must.Eq(t, int(syscall.SIGTERM), waitExit(t, p).Signal)
	})

	t.Run("kill takes the whole cgroup", func(t *testing.T) {
		tt := newTestSpec(t, "/bin/sh", "-c", `sleep 100 & sleep 100 & echo started; wait`)
		p := startTest(t, tt)
		waitFor(t, "children", func() bool { return readFile(t, tt.stdout) == "started\n" })
		must.NoError(t, p.Kill())
		st := waitExit(t, p)
		must.Eq(t, int(syscall.SIGKILL), st.Signal, must.Sprintf("status %+v", st))
		must.Eq(t, 0, len(processesMentioning(t, tt.spec.TaskID)))
	})

	t.Run("supervisor ignores termination signals", func(t *testing.T) {
		tt := newTestSpec(t, "sleep", "100")
		p := startTest(t, tt)
		sup := p.State().SupervisorPID
		for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGPIPE} {
			must.NoError(t, unix.Kill(sup, sig))
		}
		time.Sleep(100 * time.Millisecond)
		must.NoError(t, unix.Kill(sup, 0))
		must.NoError(t, unix.Kill(p.Pid(), 0))
		must.NoError(t, p.Signal(syscall.SIGTERM))
		must.Eq(t, int(syscall.SIGTERM), waitExit(t, p).Signal)
	})

	t.Run("wait honours its context", func(t *testing.T) {
		tt := newTestSpec(t, "sleep", "100")
		p := startTest(t, tt)
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, err := p.Wait(ctx)
		must.ErrorIs(t, err, context.DeadlineExceeded)
		must.NoError(t, p.Signal(0))
		must.ErrorContains(t, p.Destroy(), "still running")
	})
}

func TestRecover_FreshProcessValue_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", "sleep 0.5; exit 7")
	p := startTest(t, tt)
	st := p.State()
	must.Eq(t, p.Pid(), st.TaskPID)
	must.Positive(t, st.SupervisorStart)
	must.Positive(t, st.TaskStart)

	// A round trip through JSON, as in Nomad's TaskState.
	b, err := json.Marshal(st)
	must.NoError(t, err)
	var decoded State
	must.NoError(t, json.Unmarshal(b, &decoded))

	p2, err := Recover(hclog.NewNullLogger(), decoded)
	must.NoError(t, err)
	must.Eq(t, p.Pid(), p2.Pid())
	must.Eq(t, 7, waitExit(t, p2).ExitCode)

	// After the supervisor finished, Recover reads the recorded status.
	waitExit(t, p)
	p3, err := Recover(hclog.NewNullLogger(), decoded)
	must.NoError(t, err)
	must.Eq(t, 7, waitExit(t, p3).ExitCode)

	// A reused PID (wrong start time) and no record: gone.
	must.NoError(t, os.Remove(filepath.Join(st.StateDir, wire.ExitFile)))
	bad := decoded
	bad.SupervisorStart++
	_, err = Recover(hclog.NewNullLogger(), bad)
	must.ErrorIs(t, err, ErrGone)
}

// TestRecover_OutlivesDriver_Root starts the task from a child process that
// plays the driver, SIGKILLs that child, and takes the task back here.
func TestRecover_OutlivesDriver_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", `echo up; while [ ! -e release ]; do sleep 0.05; done; exit 42`)
	specPath := filepath.Join(t.TempDir(), "spec.json")
	must.NoError(t, wire.WriteJSONAtomic(specPath, tt.spec, 0o600))

	driver := exec.Command("/proc/self/exe", "-test.run=^$")
	driver.Env = append(os.Environ(), envStartHelper+"="+specPath)
	stderrPath := filepath.Join(t.TempDir(), "helper-stderr")
	stderr, err := os.Create(stderrPath)
	must.NoError(t, err)
	defer stderr.Close()
	driver.Stderr = stderr
	out, err := driver.StdoutPipe()
	must.NoError(t, err)
	must.NoError(t, driver.Start())
	t.Cleanup(func() { _ = driver.Process.Kill(); _ = driver.Wait() })

	line, err := bufio.NewReader(out).ReadBytes('\n')
	must.NoError(t, err, must.Func(func() string { return "helper stderr: " + readFile(t, stderrPath) }))
	var st State
	must.NoError(t, json.Unmarshal(line, &st))

	// The driver dies hard.
	must.NoError(t, driver.Process.Signal(syscall.SIGKILL))
	_ = driver.Wait()

	// The task lives on with the same PID.
	must.NoError(t, unix.Kill(st.TaskPID, 0))
	start, err := wire.ProcStartTime(st.TaskPID)
	must.NoError(t, err)
	must.Eq(t, st.TaskStart, start)

	p, err := Recover(hclog.NewNullLogger(), st)
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, st.TaskPID, p.Pid())
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_, err = p.Wait(ctx)
	cancel()
	must.ErrorIs(t, err, context.DeadlineExceeded)

	must.NoError(t, os.WriteFile(filepath.Join(tt.spec.Dir, "release"), nil, 0o600))
	must.Eq(t, 42, waitExit(t, p).ExitCode)
	must.NoError(t, p.Destroy())
}

func TestRecover_SupervisorKilled_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "sleep", "100")
	p := startTest(t, tt)
	must.NoError(t, unix.Kill(p.State().SupervisorPID, syscall.SIGKILL))
	st := waitExit(t, p)
	must.StrContains(t, st.Err, "without recording")
	// The task went with its cgroup.
	waitFor(t, "task to die", func() bool { return unix.Kill(p.Pid(), 0) != nil })

	must.True(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
	_, err := Recover(hclog.NewNullLogger(), p.State())
	must.ErrorIs(t, err, ErrGone)
	// Nomad forgets a task it cannot recover and never destroys it: its
	// cgroup must not be left behind.
	must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
}

func TestStart_Errors_Root(t *testing.T) {
	requireTaskRoot(t)
	cases := []struct {
		name   string
		modify func(s *Spec)
		err    string
	}{
		{"command not found", func(s *Spec) { s.Command = "definitely-not-a-command" },
			`failed to start task: command "definitely-not-a-command" not found in PATH`},
		{"absolute command missing", func(s *Spec) { s.Command = "/nonexistent/cmd" },
			`command "/nonexistent/cmd"`},
		{"bad user", func(s *Spec) { s.User = "no-such-user-xyz" }, `user "no-such-user-xyz" not found`},
		{"bad group", func(s *Spec) { s.User = "nobody:no-such-group-xyz" }, `group "no-such-group-xyz" not found`},
		{"bad capability", func(s *Spec) { s.Capabilities = []string{"CAP_CHOWN", "CAP_FLY"} }, `unknown capability "CAP_FLY"`},
		{"bad dir", func(s *Spec) { s.Dir = "/nonexistent/dir" }, `working directory "/nonexistent/dir"`},
		{"missing mount source", func(s *Spec) {
			s.Mounts = []Mount{{Source: "/nonexistent/src", Target: "/tmp/x"}}
		}, `mount "/nonexistent/src"`},
		{"bidirectional on a private mount", func(s *Spec) {
			s.Privileged = true
			s.Mounts = []Mount{{Source: s.StateDir, Target: filepath.Join(s.Dir, "t"), Propagation: PropagationBidirectional}}
		}, "bidirectional propagation needs"},
		{"bidirectional unprivileged", func(s *Spec) {
			s.Mounts = []Mount{{Source: s.StateDir, Target: filepath.Join(s.Dir, "t"), Propagation: PropagationBidirectional}}
		}, "needs a privileged task"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tt := newTestSpec(t, "true")
			tc.modify(tt.spec)
			p, err := Start(hclog.NewNullLogger(), tt.spec, nil)
			must.Nil(t, p)
			must.ErrorContains(t, err, tc.err)
			must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID))
			must.Eq(t, 0, len(processesMentioning(t, tt.spec.StateDir)))
		})
	}
}

func TestStart_CapabilitiesAndUser_Root(t *testing.T) {
	requireTaskRoot(t)
	// Privileged means every capability the host lets this test have.
	var all uint64
	for _, line := range strings.Split(readFile(t, "/proc/self/status"), "\n") {
		if v, ok := strings.CutPrefix(line, "CapBnd:"); ok {
			_, err := fmt.Sscanf(strings.TrimSpace(v), "%x", &all)
			must.NoError(t, err)
		}
	}
	must.NonZero(t, all)

	cases := []struct {
		name   string
		modify func(s *Spec)
		check  func(t *testing.T, capEff uint64, uid string)
	}{
		{"default", func(s *Spec) {}, func(t *testing.T, c uint64, uid string) {
			must.Eq(t, "0", uid)
			must.Zero(t, c&(1<<unix.CAP_SYS_ADMIN))
			must.Zero(t, c&(1<<unix.CAP_NET_RAW))
			must.NonZero(t, c&(1<<unix.CAP_CHOWN))
			must.NonZero(t, c&(1<<unix.CAP_NET_BIND_SERVICE))
		}},
		{"privileged", func(s *Spec) { s.Privileged = true }, func(t *testing.T, c uint64, uid string) {
			must.Eq(t, all, c)
		}},
		{"custom set", func(s *Spec) { s.Capabilities = []string{"sys_admin", "CAP_NET_RAW"} },
			func(t *testing.T, c uint64, uid string) {
				must.Eq(t, uint64(1<<unix.CAP_SYS_ADMIN|1<<unix.CAP_NET_RAW), c)
			}},
		{"nobody", func(s *Spec) { s.User, s.Dir = "nobody", "/" }, func(t *testing.T, c uint64, uid string) {
			must.Eq(t, "65534", uid)
			must.Zero(t, c)
		}},
		{"numeric uid and group", func(s *Spec) { s.User, s.Dir = "1234:nogroup", "/" }, func(t *testing.T, c uint64, uid string) {
			must.Eq(t, "1234", uid)
			must.Zero(t, c)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tt := newTestSpec(t, "/bin/sh", "-c", "id -u; cat /proc/self/status")
			tc.modify(tt.spec)
			p := startTest(t, tt)
			must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
			out := readFile(t, tt.stdout)
			uid, status, _ := strings.Cut(out, "\n")
			tc.check(t, capEff(t, status), uid)
		})
	}
}

func TestStart_OOMScoreAdjAndCgroup_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", "cat /proc/self/oom_score_adj; cat /proc/self/cgroup")
	tt.spec.OOMScoreAdj = 500
	p := startTest(t, tt)
	must.Eq(t, 0, waitExit(t, p).ExitCode)
	out := readFile(t, tt.stdout)
	must.StrHasPrefix(t, "500\n", out)
	must.StrContains(t, out, tt.spec.CgroupParent+"/"+tt.spec.TaskID)
}

func TestStart_OOMKilled_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", `x=a; while :; do x="$x$x"; done`)
	tt.spec.Limits.MemoryBytes = 32 << 20
	p := startTest(t, tt)
	st := waitExit(t, p)
	must.True(t, st.OOMKilled, must.Sprintf("status %+v", st))
	must.Eq(t, int(syscall.SIGKILL), st.Signal)
}

// The driver hears of a task only once the supervisor's launching thread
// has left the task's cgroup (v1): a kill right after the start must not
// find the supervisor in the group and take it with the task, losing the
// exit status.
func TestStart_SupervisorOutOfGroupWhenReady_Root(t *testing.T) {
	requireTaskRoot(t)
	for i := range 20 {
		tt := newTestSpec(t, "sleep", "100")
		p := startTest(t, tt)
		pids, err := p.group.Pids()
		must.NoError(t, err)
		must.SliceNotContains(t, pids, p.State().SupervisorPID, must.Sprintf("start %d: the supervisor is in the task's cgroup", i))
		must.NoError(t, p.Kill())
		st := waitExit(t, p)
		must.Eq(t, int(syscall.SIGKILL), st.Signal, must.Sprintf("start %d: status %+v", i, st))
	}
}

// The forks and threads a task's process limit refused are counted in its
// exit status; a task without a limit counts none.
func TestStart_PidsLimited_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, tc := range []struct {
		name    string
		max     int64
		limited bool
	}{{"limit 6", 6, true}, {"no limit", 0, false}} {
		t.Run(tc.name, func(t *testing.T) {
			tt := newTestSpec(t, "/bin/sh", "-c", `i=0; while [ $i -lt 12 ]; do sleep 30 & i=$((i+1)); done; exit 3`)
			tt.spec.Limits.PidsMax = tc.max
			p := startTest(t, tt)
			st := waitExit(t, p)
			must.Eq(t, tc.limited, st.PidsLimited > 0, must.Sprintf("status %+v", st))
		})
	}
}

// A process limit too small for the task's first process fails the start
// with an error that names the limit, and leaves no group behind. On
// cgroup v1 the launching thread counts against the limit while it forks
// the task (or its seccomp stage), so 1 leaves no room; on v2 the task is
// cloned into its group and 1 is room for it. A seccomp stage run in Go
// (a driver built without the shim, as these tests run it) needs threads
// of its own: a limit of 2, enough for the shim's stage, can refuse one,
// and the start names the limit then too.
func TestStart_PidsLimitTooSmall_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, limit := range []int64{1, 2} {
		for _, isolated := range []bool{false, true} {
			t.Run(fmt.Sprintf("limit=%d/isolated=%v", limit, isolated), func(t *testing.T) {
				tt := newTestSpec(t, "/bin/true")
				if isolated {
					tt = isolatedSpec(t, "true")
				}
				tt.spec.Limits.PidsMax = limit
				p, err := Start(hclog.NewNullLogger(), tt.spec, nil)
				if err == nil {
					defer p.Destroy()
					st := waitExit(t, p)
					must.Eq(t, 0, st.ExitCode, must.Sprintf("status %+v", st))
					t.Logf("a limit of %d started the task here: %+v", limit, st)
					return
				}
				t.Logf("start: %v", err)
				must.StrContains(t, err.Error(), fmt.Sprintf("pids_limit %d", limit))
				must.False(t, cgroupExists(tt.spec.CgroupParent, tt.spec.TaskID), must.Sprint("the failed start left its cgroup"))
			})
		}
	}
}

// Nomad's logmon opens the read side of its FIFOs in the background: a task
// started before the reader is there waits for it instead of failing.
func TestStart_WaitsForLogFIFOReader_Root(t *testing.T) {
	requireTaskRoot(t)
	tt := newTestSpec(t, "/bin/sh", "-c", "echo through-the-fifo")
	fifo := filepath.Join(t.TempDir(), "stdout.fifo")
	must.NoError(t, unix.Mkfifo(fifo, 0o600))
	tt.spec.StdoutPath = fifo

	got := make(chan string, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		f, err := os.Open(fifo)
		if err != nil {
			got <- err.Error()
			return
		}
		defer f.Close()
		b, _ := io.ReadAll(f)
		got <- string(b)
	}()
	p := startTest(t, tt)
	must.Eq(t, 0, waitExit(t, p).ExitCode)
	select {
	case out := <-got:
		must.Eq(t, "through-the-fifo\n", out)
	case <-time.After(10 * time.Second):
		t.Fatal("the reader got nothing")
	}
}

// The report is read with a deadline, whether the supervisor says nothing,
// goes away or reports.
func TestReadReport(t *testing.T) {
	r, w, err := os.Pipe()
	must.NoError(t, err)
	defer r.Close()
	_, err = readReport(r, 50*time.Millisecond)
	must.ErrorContains(t, err, "supervisor did not report within 50ms")

	go func() {
		_, _ = w.Write([]byte(`{"task_pid":42,"task_start":7,"cgroup":{"version":1}}` + "\n"))
	}()
	rep, err := readReport(r, time.Second)
	must.NoError(t, err)
	must.Eq(t, 42, rep.TaskPID)
	must.Eq(t, uint64(7), rep.TaskStart)

	must.NoError(t, w.Close())
	_, err = readReport(r, time.Second)
	must.ErrorContains(t, err, "supervisor exited before reporting")
}

// A supervisor gets GOMAXPROCS=1, unless the driver's environment sets it,
// and nothing of the driver's environment but what a Go program reads.
func TestSupervisorEnv(t *testing.T) {
	t.Setenv("GOMAXPROCS", "")
	os.Unsetenv("GOMAXPROCS")
	t.Setenv("SECRET_TOKEN", "hunter2")
	env := supervisorEnv()
	must.SliceContains(t, env, "GOMAXPROCS=1")
	must.SliceNotContains(t, env, "SECRET_TOKEN=hunter2")

	t.Setenv("GOMAXPROCS", "4")
	env = supervisorEnv()
	must.SliceContains(t, env, "GOMAXPROCS=4")
	must.SliceNotContains(t, env, "GOMAXPROCS=1")
}
