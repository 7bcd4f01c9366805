//go:build e2e

package e2e

// The hostile tenant's holes 5 to 7 (issue 20), each against a real agent
// and checked on the host:
//
//   - TestEscapeFullDisk: a task of one namespace takes every inode and
//     block of the file system that holds root_dir and the allocations'
//     directories (as root_dir and data_dir share a disk on most nodes);
//     another namespace's batch task that was running still reports its
//     exit code 0, and the driver stays healthy, saying the file system is
//     full and the fix; once the files go, the description says healthy.
//   - TestEscapeTerminalText: a job whose command, work_dir or user holds
//     a terminal's escape sequences (OSC window title, CSI clear screen and
//     colour, the 8-bit CSI, a bidi override) fails to start; the events,
//     `nomad alloc status` and the agent's log hold them escaped, never raw.
//   - TestEscapeMetricsEndpoint: a task on the host network cannot read the
//     driver's metrics (other namespaces' volume ids and usage): on TCP
//     without the token it gets 401, and a TCP endpoint without a token is
//     refused by the driver's config; on a unix socket the task cannot
//     reach it, nor can a host process of another user than root.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/nomad/api"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// hostileJob is a job rendered from e2e/jobs/hostile.hcl.
type hostileJob struct {
	Namespace string // default: "default"
	Type      string // batch (default) or service
	Command   string
	Args      []string
	WorkDir   string
	User      string
	Memory    int // MiB, default 64
}

// hostileRun submits the job and returns it; it is stopped and purged when
// the test ends.
func hostileRun(t *testing.T, a *Agent, j hostileJob) Job {
	t.Helper()
	ns := j.Namespace
	if ns == "" {
		ns = "default"
	}
	vars := map[string]string{"Namespace": ns, "Type": j.Type, "Command": volHCLString(j.Command),
		"Args": volHCLList(j.Args), "WorkDir": "", "User": "", "Memory": fmt.Sprint(j.Memory)}
	if vars["Type"] == "" {
		vars["Type"] = "batch"
	}
	if j.Memory == 0 {
		vars["Memory"] = "64"
	}
	if j.WorkDir != "" {
		vars["WorkDir"] = volHCLString(j.WorkDir)
	}
	if j.User != "" {
		vars["User"] = volHCLString(j.User)
	}
	job, err := a.RenderJob("hostile", vars)
	must.NoError(t, err)
	t.Cleanup(func() { stopNamespaced(t, a, ns, job.ID) })
	out, err := a.Nomad("job", "run", "-detach", job.File)
	must.NoError(t, err, must.Sprint(out))
	return job
}

// hostileNamespace makes a namespace for the test.
func hostileNamespace(t *testing.T, a *Agent, name string) string {
	t.Helper()
	out, err := a.Nomad("namespace", "apply", "-description", "hostile tenant e2e", name)
	must.NoError(t, err, must.Sprint(out))
	return name
}

// ---- 5. Inodes and blocks shared with the driver ----

// hostileFiller takes every inode, then every block, of the file system
// /alloc/data is on, as nobody, and sleeps; it says FILLED with the count
// (which may be lost: writing it needs a block too).
const hostileFiller = `i=0
while true > "/alloc/data/f$i" 2>/dev/null; do i=$((i+1)); done
echo "FILLED $i inodes"
dd if=/dev/zero of=/alloc/data/f0 bs=64k 2>/dev/null
echo DONE
exec sleep 600
`

func TestEscapeFullDisk(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	var disk string
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName}, Prepare: func(a *Agent) error {
		// One small file system for root_dir and the allocations'
		// directories, as on a node whose /var holds both: few inodes,
		// few blocks, never the machine's disk.
		disk = filepath.Join(a.Dir, "disk")
		if err := os.Mkdir(disk, 0o755); err != nil {
			return err
		}
		if err := unix.Mount("tmpfs", disk, "tmpfs", 0, "size=48m,nr_inodes=3000,mode=0755"); err != nil {
			return err
		}
		a.DriverRoot = filepath.Join(disk, "csi")
		if err := os.Mkdir(a.DriverRoot, 0o700); err != nil {
			return err
		}
		a.opts.ClientConfig += fmt.Sprintf("  alloc_dir = %q\n", filepath.Join(disk, "alloc"))
		return nil
	}})
	allocDir := filepath.Join(disk, "alloc")
	u := escUniq()
	victimNS := hostileNamespace(t, a, "victim-"+u)
	hostileNS := hostileNamespace(t, a, "hostile-"+u)

	// The victim runs until the test makes its /local/go executable: a
	// change that takes no inode and no block, nor frees one.
	victim := hostileRun(t, a, hostileJob{Namespace: victimNS, Command: "/bin/sh", User: "nobody",
		Args: []string{"-c", `: > /local/go; echo started; while [ ! -x /local/go ]; do sleep 0.2; done; exit 0`}})
	al := waitNamespacedAlloc(t, a, victimNS, victim.ID, escTimeout, StatusRunning)
	goFile := filepath.Join(allocDir, al.ID, "t", "local", "go")
	waitPath(t, goFile, escTimeout)

	// The hostile task fills the file system.
	filler := hostileRun(t, a, hostileJob{Namespace: hostileNS, Type: "service", Command: "/bin/sh", User: "nobody",
		Args: []string{"-c", hostileFiller}, Memory: 128})
	fal := waitNamespacedAlloc(t, a, hostileNS, filler.ID, escTimeout, StatusRunning)
	// It takes the inodes first, then the blocks: once no block is free,
	// it is done. An inode given back meanwhile (a spare supervisor that
	// could not prepare its root removes what it made) is taken by the
	// test, as below.
	var st unix.Statfs_t
	deadline := time.Now().Add(escTimeout)
	for {
		must.NoError(t, unix.Statfs(disk, &st))
		if st.Bfree == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the hostile task did not fill the file system: %d inodes and %d blocks free", st.Ffree, st.Bfree)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if st.Ffree != 0 {
		t.Logf("%d inodes were given back during the fill: filled again by the test", st.Ffree)
		fillUp(t, disk, filepath.Join(allocDir, fal.ID, "alloc", "data", "f0"))
		must.NoError(t, unix.Statfs(disk, &st))
		if st.Ffree != 0 || st.Bfree != 0 {
			t.Fatalf("the file system has room again (%d inodes, %d blocks): the case proves nothing", st.Ffree, st.Bfree)
		}
	}
	t.Logf("the hostile task filled %s: %d of %d inodes free, %d of %d blocks free", disk, st.Ffree, st.Files, st.Bfree, st.Blocks)
	filled := time.Now()

	// The driver's next fingerprint (every 30s) sees the full file system:
	// it stays healthy and says what is full and the fix.
	var drv *api.DriverInfo
	deadline = time.Now().Add(45 * time.Second)
	for {
		drv = a.Node(t).Drivers[DriverName]
		if drv != nil && (!drv.Healthy || strings.Contains(drv.HealthDescription, "root_dir")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no fingerprint of the full file system within 45s of the fill: %+v", drv)
		}
		time.Sleep(time.Second)
	}
	t.Logf("the driver %.0fs after the fill: healthy=%t detected=%t: %s", time.Since(filled).Seconds(), drv.Healthy, drv.Detected, drv.HealthDescription)
	if !drv.Healthy || !drv.Detected {
		t.Errorf("ESCAPED: a task of namespace %s took the driver out of the node: healthy=%t detected=%t: %s",
			hostileNS, drv.Healthy, drv.Detected, drv.HealthDescription)
	}
	for _, want := range []string{"has no free inodes left", "keep root_dir on a file system of its own"} {
		if !strings.Contains(drv.HealthDescription, want) {
			t.Errorf("the driver's health description does not say %q: %q", want, drv.HealthDescription)
		}
	}
	if got := a.Node(t).Attributes["driver.csi.root_dir_full"]; got != "inodes" {
		t.Errorf("driver.csi.root_dir_full is %q, want \"inodes\"", got)
	}

	// The victim ends with exit code 0, its status written on the full
	// file system.
	must.NoError(t, unix.Statfs(disk, &st))
	if st.Ffree != 0 || st.Bfree != 0 {
		// Room was given back meanwhile (a spare supervisor that could not
		// prepare its root on the full file system removes what it made):
		// the test takes it, so that the victim's exit is still written on
		// a full file system.
		t.Logf("the file system has room again (%d inodes, %d blocks): filled again by the test", st.Ffree, st.Bfree)
		fillUp(t, disk, filepath.Join(allocDir, fal.ID, "alloc", "data", "f0"))
		must.NoError(t, unix.Statfs(disk, &st))
		if st.Ffree != 0 || st.Bfree != 0 {
			t.Fatalf("the file system has room again (%d inodes, %d blocks): the case proves nothing", st.Ffree, st.Bfree)
		}
	}
	must.NoError(t, os.Chmod(goFile, 0o755))
	al = waitNamespacedAlloc(t, a, victimNS, victim.ID, escTimeout, StatusComplete, StatusFailed)
	t.Logf("the victim in namespace %s:\n%s", victimNS, al.Describe())
	var exit string
	for _, e := range al.Events("t") {
		if e.Type == "Terminated" {
			exit = e.Details["exit_code"]
		}
	}
	if al.ClientStatus != StatusComplete || exit != "0" {
		t.Errorf("ESCAPED: namespace %s's batch task lost its exit code to namespace %s's files: status %s, exit code %q",
			victimNS, hostileNS, al.ClientStatus, exit)
	}

	// Once the files go, the driver says it is healthy again.
	stopNamespaced(t, a, hostileNS, filler.ID)
	must.NoError(t, os.RemoveAll(filepath.Join(allocDir, fal.ID, "alloc", "data")))
	// The driver looks again within its fingerprint period (30s); Nomad
	// then updates the node.
	wait := Scaled(45 * time.Second)
	deadline = time.Now().Add(wait)
	for {
		drv = a.Node(t).Drivers[DriverName]
		if drv != nil && drv.Healthy && drv.HealthDescription == "Healthy" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the driver did not say healthy within %s of the files' removal: %+v", wait, drv)
		}
		time.Sleep(time.Second)
	}
	_, stillFull := a.Node(t).Attributes["driver.csi.root_dir_full"]
	must.False(t, stillFull, must.Sprint("driver.csi.root_dir_full stayed on the node"))
}

// fillUp takes what room is left on the file system at dir: files until
// no inode is left, then blocks, appended to file (one already there)
// until none is. The files stay until the file system is unmounted.
func fillUp(t *testing.T, dir, file string) {
	t.Helper()
	for i := 0; ; i++ {
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf(".fill-%d", i)))
		if err != nil {
			break
		}
		f.Close()
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_APPEND, 0)
	must.NoError(t, err)
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			return
		}
	}
}

// waitPath waits until path exists on the host.
func waitPath(t *testing.T, path string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		_, err := os.Lstat(path)
		if err == nil {
			return
		}
		if !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			t.Fatalf("%s did not appear within %s: %v", path, timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ---- 6. Terminal escapes in job text ----

// hostileText sets the terminal's window title (OSC, ended by BEL), clears
// the screen and writes fake red text (CSI), does it again with the 8-bit
// CSI (C1), and reverses what follows (a bidi override). hostileMark, its
// title escaped, shows that the text reached a message.
const (
	hostileText = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mFAKE-RED\x1b[0m\u009b2J\u202egnp.exe"
	hostileMark = `\x1b]0;PWNED`
)

// hostileRaw reports whether s holds anything of hostileText that a
// terminal acts on.
func hostileRaw(s string) bool { return strings.ContainsAny(s, "\x1b\x07\u009b\u202e") }

func TestEscapeTerminalText(t *testing.T) {
	t.Parallel()
	requireCSI(t)
	a := StartAgent(t, AgentOptions{Drivers: []string{DriverName}})
	for _, c := range []struct {
		name string
		job  hostileJob
	}{
		{"command", hostileJob{Command: "/nonexistent/" + hostileText}},
		{"work_dir", hostileJob{Command: "/bin/true", WorkDir: "/nonexistent/" + hostileText}},
		{"user", hostileJob{Command: "/bin/true", User: "nobody" + hostileText}},
	} {
		t.Run(c.name, func(t *testing.T) {
			job := hostileRun(t, a, c.job)
			al := a.WaitAlloc(t, job.ID, escTimeout, StatusFailed, StatusComplete)
			text := eventsText(al, "t")
			t.Logf("events:\n%s", al.Describe())
			if !strings.Contains(text, hostileMark) {
				t.Fatalf("no event carries the job's text: the case proves nothing:\n%s", al.Describe())
			}
			if hostileRaw(text) {
				t.Errorf("ESCAPED: the task's events hold the job's terminal escapes raw: %q", text)
			}
			out, err := a.Nomad("alloc", "status", al.ID)
			must.NoError(t, err, must.Sprint(out))
			if hostileRaw(out) {
				t.Errorf("ESCAPED: nomad alloc status prints the job's terminal escapes raw: %q", out)
			}
		})
	}
	log, err := a.ReadLog()
	must.NoError(t, err)
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "PWNED") && hostileRaw(line) {
			t.Errorf("ESCAPED: the agent's log holds the job's terminal escapes raw: %q", line)
		}
	}
}

// ---- 7. The metrics endpoint ----

// hostileMetricsTask is a task on the host network (the driver's default
// without a network block) that GETs each URL given with netprobe, then
// says DONE.
func hostileMetricsTask(t *testing.T, a *Agent, user string, urls ...string) string {
	t.Helper()
	probe := filepath.Join(TaskCSIBinDir, "netprobe")
	var script strings.Builder
	for _, u := range urls {
		fmt.Fprintf(&script, "echo \"URL %s\"; %s get %q\n", u, probe, u)
	}
	script.WriteString("echo DONE\n")
	job := hostileRun(t, a, hostileJob{Command: "/bin/sh", User: user, Args: []string{"-c", script.String()}})
	al := a.WaitAlloc(t, job.ID, escTimeout, StatusComplete, StatusFailed)
	out := escLogs(t, a, al.ID, "t")
	if !strings.Contains(out, "DONE") {
		t.Fatalf("the task did not run to its end:\n%s", al.Describe())
	}
	return out
}

// metricsFixture starts an agent whose driver serves metrics as extra
// says, and a volume task of another namespace, so that the endpoint has a
// volume id to give away; it returns the agent and the volume's name.
func metricsFixture(t *testing.T, extra string) (*Agent, string) {
	t.Helper()
	csiBin(t, "netprobe")
	csiBin(t, "csi-fixture")
	a := StartAgent(t, AgentOptions{AllowPrivileged: true, DriverConfig: "volume_stats_interval = \"1s\"\n" + extra})
	t.Cleanup(func() { volFinalCheck(t, a) })
	fx := a.StartVolFixture(t, "metricsesc", VolFixtureOptions{})
	name := volUniq("secretvol")
	dest := filepath.Join(volDir(a, name), "data")
	job := a.RunVolJob(t, VolJob{Type: "service", Script: fmt.Sprintf("echo hi > %s/f && echo wrote && sleep 600", dest),
		Volumes: []VolSpec{{Name: "data", Plugin: fx.ID, ID: name, Dest: dest, Create: true, CreateType: "dir"}}})
	al := a.WaitAlloc(t, job.ID, volTimeout, StatusRunning)
	a.WaitLogs(t, al.ID, "t", "wrote", volTimeout)
	return a, fx.VolumeID(name)
}

func TestEscapeMetricsEndpoint(t *testing.T) {
	t.Parallel()
	requireCSI(t)

	// On TCP, a token: a task on the host network gets 401 without it.
	t.Run("tcp_token", func(t *testing.T) {
		tokenDir := t.TempDir()
		tokenFile := filepath.Join(tokenDir, "metrics.token")
		token := "tok-" + escUniq() + "-0123456789abcdef"
		must.NoError(t, os.WriteFile(tokenFile, []byte(token+"\n"), 0o600))
		ports, err := freePorts(1)
		must.NoError(t, err)
		addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
		a, volID := metricsFixture(t, fmt.Sprintf("metrics_address = %q\nmetrics_token_file = %q\n", addr, tokenFile))

		// The scraper with the token reads the volume's series.
		text := scrapeWith(t, "http://"+addr+"/metrics", token, "")
		must.StrContains(t, text, volID)

		out := hostileMetricsTask(t, a, "nobody", "http://"+addr+"/metrics", fmt.Sprintf("%s/v1/agent/self", a.Addr))
		metrics, self, _ := strings.Cut(out, "URL "+a.Addr)
		if strings.Contains(metrics, volID) || strings.Contains(metrics, "nomad_driver_csi_") {
			t.Errorf("ESCAPED: a host-network task read the driver's metrics (another namespace's volume %s):\n%s", volID, metrics)
		}
		must.StrContains(t, metrics, "GET status=401")
		// What the agent shows every host-network task of the plugin's
		// config (ACLs off): the token file's path, never the token.
		must.StrContains(t, self, "metrics_token_file")
		must.StrNotContains(t, self, token)
	})

	// On TCP without a token, the driver refuses the config: the agent
	// has no csi driver, and says why.
	t.Run("tcp_without_token_refused", func(t *testing.T) {
		ports, err := freePorts(1)
		must.NoError(t, err)
		addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
		a, err := NewAgent(AgentOptions{AllowPrivileged: true, Logf: t.Logf,
			DriverConfig: fmt.Sprintf("metrics_address = %q\n", addr)})
		if err == nil {
			defer a.Close()
			// The driver serves the README's old advice: a task on the
			// host network reads it.
			csiBin(t, "netprobe")
			out := hostileMetricsTask(t, a, "nobody", "http://"+addr+"/metrics")
			if strings.Contains(out, "nomad_driver_csi_") {
				t.Errorf("ESCAPED: a host-network task read the driver's metrics on %s:\n%s", addr, out)
			}
			t.Fatalf("the driver took metrics_address %q without a token", addr)
		}
		must.StrContains(t, err.Error(), "metrics_token_file")
		t.Logf("refused: %v", firstLine(err.Error()))
	})

	// On a unix socket: the task cannot reach it, a host process of
	// another user cannot connect, root's scraper can.
	t.Run("unix_socket", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "run")
		sock := filepath.Join(dir, "m.sock")
		a, volID := metricsFixture(t, fmt.Sprintf("metrics_address = %q\n", "unix://"+sock))
		fi, err := os.Lstat(sock)
		must.NoError(t, err)
		must.Eq(t, os.ModeSocket, fi.Mode().Type())
		must.Eq(t, os.FileMode(0o600), fi.Mode().Perm())
		must.Eq(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid)

		text := scrapeWith(t, "http://unix/metrics", "", sock)
		must.StrContains(t, text, volID)

		for _, user := range []string{"nobody", "root"} {
			out := hostileMetricsTask(t, a, user, "unix://"+sock+":/metrics")
			if strings.Contains(out, volID) || strings.Contains(out, "GET status=") {
				t.Errorf("ESCAPED: a task (user %s) reached the metrics socket:\n%s", user, out)
			}
			must.StrContains(t, out, "GET fail")
		}
		// A host process as nobody: the directory and socket are root's.
		// nobody runs a copy of netprobe in a directory it can enter: the
		// tree's build/ may sit under one it cannot (a clone in mktemp -d,
		// 0700), which failed the exec before the socket was tried.
		bin, err := os.MkdirTemp("", "netprobe-")
		must.NoError(t, err)
		t.Cleanup(func() { os.RemoveAll(bin) })
		must.NoError(t, os.Chmod(bin, 0o755))
		probe := filepath.Join(bin, "netprobe")
		must.NoError(t, copyFile(filepath.Join(CSIBinDir(a.Root), "netprobe"), probe, 0o755))
		cmd := exec.Command(probe, "get", "unix://"+sock+":/metrics")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		b, err := cmd.CombinedOutput()
		must.NoError(t, err, must.Sprint(string(b)))
		t.Logf("a host process as nobody: %s", strings.TrimSpace(string(b)))
		must.StrContains(t, string(b), "GET fail permission denied")
	})
}

// scrapeWith GETs url with the bearer token (when set), over the unix
// socket sock (when set), and returns the body of a 200.
func scrapeWith(t *testing.T, url, token, sock string) string {
	t.Helper()
	tr := &http.Transport{}
	if sock != "" {
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}
	}
	c := http.Client{Timeout: 10 * time.Second, Transport: tr}
	deadline := time.Now().Add(volTimeout)
	for {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		must.NoError(t, err)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := c.Do(req)
		if err == nil {
			var b strings.Builder
			_, _ = io.Copy(&b, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && strings.Contains(b.String(), "nomad_driver_csi_volume_bytes") {
				return b.String()
			}
			err = fmt.Errorf("%s: %.200s", resp.Status, b.String())
		}
		if time.Now().After(deadline) {
			t.Fatalf("the scraper could not read the volume's series from %s: %v", url, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
