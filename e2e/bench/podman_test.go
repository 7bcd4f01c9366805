//go:build e2e

package bench

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e"
)

// podman runs Debian's Podman (4.3) as this host allows it: as root, with
// runc (crun refuses this hybrid cgroup host), cgroupfs (no systemd), and
// rlimits below the host's hard limits; with a storage and run directory
// of its own, so that nothing of the host's Podman state is touched and
// everything goes at the end.
type podman struct {
	bin  string
	root string
	run  string
	// certDir holds the registry's CA as ca.crt (podman's --cert-dir).
	certDir string
}

// newPodman prepares a podman whose state lives under a temporary
// directory of its own; the benchmark ends with every container and image
// of it gone and its mounts unmounted.
func newPodman(b *testing.B, caFile string) *podman {
	b.Helper()
	bin, err := exec.LookPath("podman")
	if err != nil {
		b.Fatalf("the image benchmark compares with Podman, which is not installed (make bench installs Debian's podman): %v", err)
	}
	base := e2e.OwnedTempDir(b, "ncsb-")
	p := &podman{bin: bin, root: filepath.Join(base, "root"), run: filepath.Join(base, "run"), certDir: filepath.Join(base, "certs")}
	if err := os.MkdirAll(p.certDir, 0o700); err != nil {
		b.Fatal(err)
	}
	if caFile != "" {
		ca, err := os.ReadFile(caFile)
		if err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p.certDir, "ca.crt"), ca, 0o600); err != nil {
			b.Fatal(err)
		}
	}
	b.Cleanup(func() {
		_, _ = p.cmd("rm", "--all", "--force", "--time", "0")
		_, _ = p.cmd("rmi", "--all", "--force")
		_, _ = p.cmd("system", "reset", "--force")
		if err := e2e.UnmountUnder(base); err != nil {
			b.Errorf("podman left mounts under %s: %v", base, err)
			return
		}
		_ = os.RemoveAll(base)
	})
	return p
}

func (p *podman) cmd(args ...string) (string, error) {
	full := append([]string{"--root", p.root, "--runroot", p.run, "--cgroup-manager", "cgroupfs",
		"--events-backend", "file", "--runtime", "runc"}, args...)
	out, err := exec.Command(p.bin, full...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("podman %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

// pull pulls ref from the registry with creds ("user:password") and
// returns how long it took.
func (p *podman) pull(b *testing.B, ref, creds string) time.Duration {
	b.Helper()
	t0 := time.Now()
	if _, err := p.cmd("pull", "--quiet", "--cert-dir", p.certDir, "--creds", creds, ref); err != nil {
		b.Fatal(err)
	}
	return time.Since(t0)
}

// runPrivileged starts a privileged container of ref, detached, on the
// host's network, with args, and returns how long podman took to report it
// started; the container is removed before returning.
func (p *podman) runPrivileged(b *testing.B, ref string, args ...string) time.Duration {
	b.Helper()
	t0 := time.Now()
	id, err := p.cmd(append([]string{"run", "--detach", "--privileged", "--network", "host",
		"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096", ref}, args...)...)
	elapsed := time.Since(t0)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := p.cmd("rm", "--force", "--time", "0", id); err != nil {
		b.Fatal(err)
	}
	return elapsed
}

// removeImage removes ref from podman's store (the next run is cold).
func (p *podman) removeImage(b *testing.B, ref string) {
	b.Helper()
	if _, err := p.cmd("rmi", "--force", ref); err != nil {
		b.Fatal(err)
	}
}
