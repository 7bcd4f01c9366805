//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The systemd mode: the client agent of a Persistent agent runs as a
// systemd unit made from examples/systemd/nomad-client.service, the unit
// the README tells operators to install (Delegate=yes, KillMode=process,
// KillSignal=SIGINT, ...), with only its ExecStart replaced by the
// harness's command line and its output appended to the agent's log.
// Restart is "systemctl restart", Stop "systemctl stop": what systemd does
// to the agent's processes, the driver plugin and the task supervisors
// among them, is what the cases see. AgentOptions.Systemd asks for it;
// E2E_SYSTEMD=1 asks for it for every Persistent agent (make e2e-vm sets it
// in the guest, where systemd is PID 1).

// SystemdEverywhere is E2E_SYSTEMD=1.
var SystemdEverywhere = os.Getenv("E2E_SYSTEMD") == "1"

// exampleUnit is the unit file the systemd mode starts from.
const exampleUnit = "examples/systemd/nomad-client.service"

// unitDir holds the harness's units: under /run, so a unit a crashed run
// left is gone at the next boot.
const unitDir = "/run/systemd/system"

// SystemdRunning tells whether systemd is PID 1 here, and why not.
func SystemdRunning() error {
	fi, err := os.Stat("/run/systemd/system")
	if err != nil || !fi.IsDir() {
		return errors.New("systemd is not PID 1 here (no /run/systemd/system)")
	}
	if _, err := exec.LookPath("systemctl"); err != nil {
		return fmt.Errorf("systemctl is missing: %w", err)
	}
	return nil
}

// systemctl runs systemctl with args, for at most timeout.
func systemctl(timeout time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, "systemctl", args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("systemctl %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return strings.TrimSpace(string(out)), nil
}

// unitJob asks systemd to verb ("start", "restart", "stop") the unit
// without waiting on the bus (systemctl's wait for a long job times out
// after 25s in a slow guest), then polls the unit until it is stopped
// (stop) or runs a main process other than old (start, restart), for at
// most timeout.
func unitJob(verb, unit string, old int, timeout time.Duration) error {
	if _, err := systemctl(Scaled(30*time.Second), "--no-block", verb, unit); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	state := ""
	// A restart's stop part can leave the unit failed for a moment (when
	// the agent's exit on the unit's SIGINT does not count as a success)
	// before its start part runs: failed is the unit's answer only once it
	// lasts. A restart in the guest failed so while the agent came back
	// and recovered its tasks (c32's agent log). A unit whose start fails stays failed (or, with
	// Restart=on-failure, is failed again when its restarts run out).
	var failedSince time.Time
	for {
		state = unitProperty(unit, "ActiveState")
		if state != "failed" {
			failedSince = time.Time{}
		} else if failedSince.IsZero() {
			failedSince = time.Now()
		}
		switch {
		case verb == "stop" && (state == "inactive" || state == "failed"):
			return nil
		case verb != "stop" && state == "failed" && time.Since(failedSince) >= Scaled(5*time.Second):
			return fmt.Errorf("systemctl %s %s: the unit failed (systemctl status %s)", verb, unit, unit)
		case verb != "stop" && state == "active":
			if pid := unitPID(unit); pid != 0 && pid != old {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("systemctl %s %s: the unit is %q after %v", verb, unit, state, timeout)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// unitProperty reads one property of a unit ("" when it cannot).
func unitProperty(unit, prop string) string {
	out, err := systemctl(Scaled(10*time.Second), "show", "-p", prop, "--value", unit)
	if err != nil {
		return ""
	}
	return out
}

// unitQuote quotes one word of a unit file's command line or environment:
// in double quotes, with \ and " escaped and % doubled (systemd's
// specifiers).
func unitQuote(s string) string {
	s = strings.ReplaceAll(s, `\`, `\\`)
	s = strings.ReplaceAll(s, `"`, `\"`)
	s = strings.ReplaceAll(s, "%", "%%")
	return `"` + s + `"`
}

// renderUnit turns the example unit into the harness's: ExecStart runs
// command, the output goes to logPath, env is added, and the [Install]
// section is dropped (the unit is started, never enabled). Every other
// line is the example's.
func renderUnit(example []byte, command []string, dir, logPath string, env []string) ([]byte, error) {
	var quoted []string
	for _, w := range command {
		quoted = append(quoted, unitQuote(w))
	}
	var b bytes.Buffer
	b.WriteString("# made by the nomad-driver-csi e2e harness from " + exampleUnit + "\n")
	section := ""
	sawExec := false
	sc := bufio.NewScanner(bytes.NewReader(example))
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "[") {
			section = trimmed
			if section == "[Install]" {
				continue
			}
		}
		if section == "[Install]" {
			continue
		}
		if section == "[Service]" && strings.HasPrefix(trimmed, "ExecStart=") {
			sawExec = true
			b.WriteString("ExecStart=" + strings.Join(quoted, " ") + "\n")
			b.WriteString("WorkingDirectory=" + dir + "\n")
			b.WriteString("StandardOutput=append:" + logPath + "\n")
			b.WriteString("StandardError=append:" + logPath + "\n")
			for _, kv := range env {
				b.WriteString("Environment=" + unitQuote(kv) + "\n")
			}
			continue
		}
		b.WriteString(line + "\n")
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if !sawExec {
		return nil, fmt.Errorf("%s has no ExecStart in its [Service] section", exampleUnit)
	}
	return b.Bytes(), nil
}

// unitName is the unit of the agent whose directory is dir.
func unitName(dir string) string { return "ncsi-e2e-" + filepath.Base(dir)[len("ncsi-"):] + ".service" }

// usesSystemd tells whether p runs as a unit.
func (a *Agent) usesSystemd(p *proc) bool {
	return p == a.client && a.opts.Persistent && a.opts.Join == nil && (a.opts.Systemd || SystemdEverywhere)
}

// unitWatch closes exited when the unit is no longer active, until stop
// is closed.
func unitWatch(unit string, exited chan struct{}, stop <-chan struct{}) {
	var once sync.Once
	for {
		select {
		case <-stop:
			return
		case <-time.After(500 * time.Millisecond):
		}
		switch unitProperty(unit, "ActiveState") {
		case "inactive", "failed":
			once.Do(func() { close(exited) })
			return
		}
	}
}

// startUnit writes the agent's unit and starts it.
func (a *Agent) startUnit(p *proc) error {
	if err := SystemdRunning(); err != nil {
		return fmt.Errorf("the systemd mode needs systemd: %w", err)
	}
	example, err := os.ReadFile(filepath.Join(a.Root, exampleUnit))
	if err != nil {
		return err
	}
	env := append([]string{"PATH=" + os.Getenv("PATH")}, a.opts.Env...)
	body, err := renderUnit(example, append([]string{NomadBinary(a.Root)}, p.args...), a.Dir, p.logPath, env)
	if err != nil {
		return err
	}
	unit := unitName(a.Dir)
	if err := os.WriteFile(filepath.Join(unitDir, unit), body, 0o644); err != nil {
		return err
	}
	a.mu.Lock()
	p.unit = unit
	a.mu.Unlock()
	if _, err := systemctl(Scaled(30*time.Second), "daemon-reload"); err != nil {
		return err
	}
	a.markLog(p, "starting (systemctl start "+unit+")")
	if err := unitJob("start", unit, 0, Scaled(60*time.Second)); err != nil {
		return err
	}
	a.watchUnit(p)
	a.opts.Logf("started nomad %s as systemd unit %s, pid=%d dir=%s", p.name, unit, p.pid(), a.Dir)
	return nil
}

// watchUnit gives p a fresh exited channel watched by unitWatch.
func (a *Agent) watchUnit(p *proc) {
	exited, stop := make(chan struct{}), make(chan struct{})
	a.mu.Lock()
	if p.stopWatch != nil {
		close(p.stopWatch)
	}
	p.exited, p.stopWatch = exited, stop
	a.mu.Unlock()
	go unitWatch(p.unit, exited, stop)
}

// restartUnit is "systemctl restart" of the agent's unit.
func (a *Agent) restartUnit(p *proc) error {
	a.recordChildren()
	a.markLog(p, "starting (systemctl restart "+p.unit+")")
	old := p.pid()
	start := time.Now()
	if err := unitJob("restart", p.unit, old, Scaled(120*time.Second)); err != nil {
		return err
	}
	a.watchUnit(p)
	a.opts.Logf("restarted systemd unit %s in %v: pid %d, then %d", p.unit, time.Since(start).Round(time.Millisecond), old, p.pid())
	return nil
}

// stopUnit is "systemctl stop" of the agent's unit, then SIGKILL to what
// is left of its main process after grace.
func (a *Agent) stopUnit(p *proc, grace time.Duration) error {
	if p.unit == "" || unitProperty(p.unit, "ActiveState") == "inactive" {
		return nil
	}
	a.markLog(p, "stopping (systemctl stop "+p.unit+")")
	err := unitJob("stop", p.unit, 0, grace)
	if err != nil {
		_, _ = systemctl(Scaled(10*time.Second), "kill", "--kill-who=main", "-s", "KILL", p.unit)
		err = fmt.Errorf("nomad %s (unit %s) did not stop within %v: %w", p.name, p.unit, grace, err)
	}
	a.mu.Lock()
	if p.stopWatch != nil {
		close(p.stopWatch)
		p.stopWatch = nil
	}
	a.mu.Unlock()
	return err
}

// removeUnit stops the unit, kills what is left in its cgroup (KillMode=
// process leaves the agent's children there, as it should for an agent
// restart; at Close they are the test's leftovers), and removes its file.
func (a *Agent) removeUnit(p *proc) {
	if p == nil || p.unit == "" {
		return
	}
	if err := a.stopUnit(p, Scaled(30*time.Second)); err != nil {
		a.opts.Logf("%v", err)
	}
	_, _ = systemctl(Scaled(10*time.Second), "kill", "--kill-who=all", "-s", "KILL", p.unit)
	if cg := unitProperty(p.unit, "ControlGroup"); cg != "" {
		dir := filepath.Join("/sys/fs/cgroup", cg)
		if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err == nil {
			_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
		}
	}
	_ = os.Remove(filepath.Join(unitDir, p.unit))
	_, _ = systemctl(Scaled(30*time.Second), "daemon-reload")
	_, _ = systemctl(Scaled(10*time.Second), "reset-failed", p.unit)
}

// unitPID is the unit's main PID (0 when it runs none).
func unitPID(unit string) int {
	pid, _ := strconv.Atoi(unitProperty(unit, "MainPID"))
	return pid
}

// markLog writes a harness line into the agent's log, as startProc does:
// registeredAgain reads the log from the last "starting" mark on.
func (a *Agent) markLog(p *proc, what string) {
	f, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "==== harness: %s %s %s at %s\n", what, NomadBinary(a.Root), strings.Join(p.args, " "), time.Now().Format(time.RFC3339Nano))
}
