package executor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/shoenig/test/must"
)

// A late mount whose source lies in a directory tasks can write (the
// allocation's alloc/logs, which another task of the allocation, of
// another driver, can rename away and replace while no task of this
// driver holds it as a mount point) is taken without following a symlink
// below its Beneath directory: the host directory the symlink names is
// never mounted into the task, and the start fails naming the source.
// A real directory in its place is mounted as before.
func TestStart_LateMountBeneathSymlink_Root(t *testing.T) {
	requireTaskRoot(t)
	allocDir := t.TempDir()
	shared := filepath.Join(allocDir, "alloc")
	logs := filepath.Join(shared, "logs")
	must.NoError(t, os.Mkdir(shared, 0o755))
	// The host directory a hostile sibling points logs at.
	host := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(host, "marker"), []byte("host file\n"), 0o644))

	for _, tc := range []struct {
		name  string
		plant func(t *testing.T)
	}{
		{"last element", func(t *testing.T) {
			must.NoError(t, os.Symlink(host, logs))
		}},
		{"parent", func(t *testing.T) {
			// alloc/ itself a symlink to a directory holding "logs".
			must.NoError(t, os.Rename(shared, shared+".real"))
			t.Cleanup(func() { _ = os.Remove(shared); _ = os.Rename(shared+".real", shared) })
			must.NoError(t, os.Symlink(filepath.Dir(host), shared))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_ = os.Remove(logs)
			tc.plant(t)
			t.Cleanup(func() { _ = os.Remove(logs) })
			src := logs
			if tc.name == "parent" {
				// alloc -> dirname(host); the source names host's base.
				src = filepath.Join(shared, filepath.Base(host))
			}
			tt := newTestSpec(t, "/bin/sh", "-c", `cat /alloc/logs/marker 2>&1; echo END`)
			tt.spec.LateMounts = []Mount{{Target: "/alloc/logs"}}
			p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
				return []Mount{{Source: src, Target: "/alloc/logs", ReadOnly: true, Beneath: allocDir}}, nil
			})
			if err == nil {
				t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
				waitExit(t, p)
			}
			out := readFile(t, tt.stdout)
			must.False(t, strings.Contains(out, "host file"), must.Sprintf("the task read the host directory a symlink in its alloc dir named: %q", out))
			must.Error(t, err)
			must.StrContains(t, err.Error(), "symlink")
			must.Eq(t, 0, len(processesMentioning(t, tt.spec.StateDir)))
		})
	}

	// The control: a real directory there is mounted, read-only.
	must.NoError(t, os.Mkdir(logs, 0o755))
	must.NoError(t, os.WriteFile(filepath.Join(logs, "marker"), []byte("the task's log\n"), 0o644))
	tt := newTestSpec(t, "/bin/sh", "-c", `cat /alloc/logs/marker`)
	tt.spec.LateMounts = []Mount{{Target: "/alloc/logs"}}
	p, err := Start(hclog.NewNullLogger(), tt.spec, func() ([]Mount, error) {
		return []Mount{{Source: logs, Target: "/alloc/logs", ReadOnly: true, Beneath: allocDir}}, nil
	})
	must.NoError(t, err)
	t.Cleanup(func() { _ = p.Kill(); _ = p.Destroy() })
	must.Eq(t, 0, waitExit(t, p).ExitCode, must.Sprintf("stderr: %s", readFile(t, tt.stderr)))
	must.Eq(t, "the task's log\n", readFile(t, tt.stdout))
}
