package executor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// newTestNetNS makes a network namespace (with only a loopback device, as
// Nomad's is before CNI adds the rest) held by a bind mount on a file, as
// Nomad holds a group's, and returns the file and the namespace's link
// ("net:[inode]"). Cleanup unmounts it.
func newTestNetNS(t *testing.T) (path, link string) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "netns")
	must.NoError(t, os.WriteFile(path, nil, 0o600))
	done := make(chan error, 1)
	go func() {
		// Never unlocked: the thread is thrown away with the namespace it
		// entered.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- err
			return
		}
		done <- unix.Mount("/proc/thread-self/ns/net", path, "", unix.MS_BIND, "")
	}()
	must.NoError(t, <-done)
	t.Cleanup(func() { _ = unix.Unmount(path, unix.MNT_DETACH) })
	var st unix.Stat_t
	must.NoError(t, unix.Stat(path, &st))
	return path, fmt.Sprintf("net:[%d]", st.Ino)
}

// netnsScript prints the task's network namespace and the network devices
// its /sys shows.
const netnsScript = `echo "net=$(readlink /proc/self/ns/net)"; echo "devices=$(ls /sys/class/net | tr '\n' ' ')"`

// A task with NetNS runs in that namespace, isolated or privileged, and an
// isolated task's /sys shows the namespace's devices, not the host's.
func TestNetNS_Task_Root(t *testing.T) {
	requireTaskRoot(t)
	hostNS, err := os.Readlink("/proc/self/ns/net")
	must.NoError(t, err)
	for _, tc := range []struct {
		name     string
		isolated bool
	}{
		{"isolated", true},
		{"privileged", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path, link := newTestNetNS(t)
			must.NotEq(t, hostNS, link)
			tt := newTestSpec(t, "/bin/sh", "-c", netnsScript)
			if tc.isolated {
				tt = isolatedSpec(t, netnsScript)
			} else {
				tt.spec.Privileged = true
			}
			tt.spec.NetNS = path
			p := startTest(t, tt)
			must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
			out := outputLines(readFile(t, tt.stdout))
			must.Eq(t, link, out["net"])
			if tc.isolated {
				must.Eq(t, "lo", out["devices"])
			}
		})
	}

	t.Run("not a network namespace", func(t *testing.T) {
		tt := isolatedSpec(t, "true")
		tt.spec.NetNS = "/proc/self/ns/mnt"
		_, err := Start(hclog.NewNullLogger(), tt.spec, nil)
		must.ErrorContains(t, err, `failed to join the task's network namespace "/proc/self/ns/mnt"`)
	})
}

// A spare's root was prepared in the host's network namespace (and, for an
// isolated task, its sysfs mounted there): a task with NetNS does not take
// it, and runs in its namespace.
func TestNetNS_SpareNotTaken_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, tc := range []struct {
		name string
		iso  *Isolation
	}{
		{"privileged", nil},
		{"isolated", &Isolation{ChrootEnv: DefaultChrootEnv, PrivatePID: true, PrivateIPC: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Spares{}
			s.SetDir(t.TempDir(), tc.iso)
			t.Cleanup(s.Close)
			s.Fill("", hclog.NewNullLogger())
			waitSpare(t, s, "")

			path, link := newTestNetNS(t)
			tt := isolatedSpec(t, netnsScript)
			tt.spec.Isolation = tc.iso
			if tc.iso == nil {
				tt.spec.Privileged, tt.spec.Capabilities = true, nil
			}
			tt.spec.NetNS = path
			p, err := s.Start(hclog.NewNullLogger(), tt.spec, nil)
			must.NoError(t, err)
			t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
			must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
			out := outputLines(readFile(t, tt.stdout))
			must.Eq(t, link, out["net"])
			if tc.iso != nil {
				must.Eq(t, "lo", out["devices"])
			}
			must.StrContains(t, readFile(t, tt.spec.StateDir+"/"+wire.SupervisorLogFile), "root_prepared_ahead=false")
		})
	}
}

// nomad alloc exec in a task with NetNS runs in the task's namespace.
func TestNetNS_Exec_Root(t *testing.T) {
	requireTaskRoot(t)
	for _, tc := range []struct {
		name     string
		isolated bool
	}{
		{"isolated", true},
		{"privileged", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path, link := newTestNetNS(t)
			tt := newTestSpec(t, "sleep", "100")
			if tc.isolated {
				tt = isolatedSpec(t, "sleep 100")
			} else {
				tt.spec.Privileged = true
			}
			tt.spec.NetNS = path
			p := startTest(t, tt)
			var stdout, stderr bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			code, err := p.Exec(ctx, ExecOptions{Command: []string{"/bin/sh", "-c", netnsScript}, Stdout: &stdout, Stderr: &stderr})
			must.NoError(t, err)
			must.Eq(t, 0, code, must.Sprintf("stderr: %s", stderr.String()))
			out := outputLines(stdout.String())
			must.Eq(t, link, out["net"])
			if tc.isolated {
				must.Eq(t, "lo", strings.TrimSpace(out["devices"]))
			}
		})
	}
}
