//go:build e2e

package e2e

// Group networking (issue 9, item 9): a group in bridge mode runs in the
// network namespace Nomad made for it and reaches another group's service
// only through the network Nomad gave it.
//
// The case starts its own agent, with the CNI reference plugins built by
// e2e/tools/build.sh as its cni_path and a bridge and subnet of its own
// (so that nothing of another run is touched). Nomad leaves the bridge,
// its iptables chains and the IPAM directory behind when it stops, and the
// bridge plugin turns on net.ipv4.ip_forward: the case removes what was
// not there before it started and puts ip_forward back, also on failure.

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// netLines maps the "KEY=VALUE" lines of a task's output.
func netLines(out string) map[string]string {
	m := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			m[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	return m
}

// netDial is netprobe's dial, from the test process (the host's network).
func netDial(addr string) string {
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return "fail " + err.Error()
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "fail read: " + err.Error()
	}
	if f := strings.Fields(line); len(f) >= 2 && f[0] == "netprobe" {
		return "ok " + f[1]
	}
	return fmt.Sprintf("fail unexpected answer %q", line)
}

// netHostListener is a service on the host's loopback only, answering as
// netprobe does with the name "host".
func netHostListener(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(c, "netprobe host %s\n", l.Addr())
			c.Close()
		}
	}()
	return l.Addr().String()
}

// run runs a command on the host and returns its output (for the
// network checks and clean-up).
func run(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}

// netState is what the host's network looked like before the case: the
// iptables rules of each table, ip_forward, and whether the IPAM
// directory was there.
type netState struct {
	rules     map[string][]string
	ipForward string
	// dirs tells which of netDirs existed.
	dirs map[string]bool
}

// netDirs are the directories bridge networking makes on the host, the
// deepest first: the IPAM leases of Nomad's bridge network ("nomad"), and
// the directory of the namespace files.
var netDirs = []string{"/var/run/cni/nomad", "/var/run/cni", "/var/run/netns"}

func iptablesRules(table string) ([]string, error) {
	out, err := run("iptables", "-w", "-t", table, "-S")
	if err != nil {
		return nil, fmt.Errorf("iptables -t %s -S: %w", table, err)
	}
	return strings.Split(strings.TrimSpace(out), "\n"), nil
}

// readNetState reads the host's network state; a part it cannot read is
// an error, so that a comparison never passes on two empty reads.
func readNetState() (netState, error) {
	s := netState{rules: map[string][]string{}, dirs: map[string]bool{}}
	var errs []error
	for _, table := range []string{"filter", "nat"} {
		rules, err := iptablesRules(table)
		errs = append(errs, err)
		s.rules[table] = rules
	}
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	errs = append(errs, err)
	s.ipForward = strings.TrimSpace(string(b))
	for _, d := range netDirs {
		_, err := os.Stat(d)
		s.dirs[d] = err == nil
	}
	return s, errors.Join(errs...)
}

// restoreNetwork removes what the case's agent left of its network and
// was not there before: links on the bridge, the bridge, iptables rules
// and chains, the IPAM directory; it puts ip_forward back. It returns what
// it found left, for the log.
func restoreNetwork(before netState, bridge string) []string {
	var left []string
	if out, err := run("ip", "-o", "link", "show", "master", bridge); err == nil && strings.TrimSpace(out) != "" {
		left = append(left, "links on the bridge: "+strings.TrimSpace(out))
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if len(f) > 1 {
				name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
				_, _ = run("ip", "link", "del", name)
			}
		}
	}
	if _, err := run("ip", "link", "show", bridge); err == nil {
		left = append(left, "bridge "+bridge)
		_, _ = run("ip", "link", "del", bridge)
	}
	for _, table := range []string{"filter", "nat"} {
		var newChains, newRules []string
		rules, err := iptablesRules(table)
		if err != nil {
			left = append(left, err.Error())
		}
		for _, r := range rules {
			if slices.Contains(before.rules[table], r) {
				continue
			}
			left = append(left, table+": "+r)
			if c, ok := strings.CutPrefix(r, "-N "); ok {
				newChains = append(newChains, c)
			} else if strings.HasPrefix(r, "-A ") {
				newRules = append(newRules, r)
			}
		}
		// A rule of a new chain goes with the chain; one in a chain that
		// was there before (FORWARD, POSTROUTING) is deleted by itself.
		// iptables -S quotes as the shell does.
		for _, r := range newRules {
			if !slices.Contains(newChains, strings.Fields(r)[1]) {
				_, _ = run("sh", "-c", "iptables -w -t "+table+" -D "+strings.TrimPrefix(r, "-A "))
			}
		}
		for _, c := range newChains {
			_, _ = run("iptables", "-w", "-t", table, "-F", c)
		}
		// Chains may jump to each other: delete until nothing more goes.
		for range len(newChains) {
			for _, c := range newChains {
				_, _ = run("iptables", "-w", "-t", table, "-X", c)
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil {
		left = append(left, "ip_forward unreadable: "+err.Error())
		_ = os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte(before.ipForward), 0)
	} else if strings.TrimSpace(string(b)) != before.ipForward {
		left = append(left, "ip_forward="+strings.TrimSpace(string(b)))
		_ = os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte(before.ipForward), 0)
	}
	for i, d := range netDirs {
		if _, err := os.Stat(d); err != nil || before.dirs[d] {
			continue
		}
		left = append(left, "directory "+d)
		if i == 0 {
			// Only the lock and last-reserved files once every lease is
			// released.
			_ = os.RemoveAll(d)
		} else if entries, err := os.ReadDir(d); err == nil && len(entries) == 0 {
			// Nomad makes the namespace directory a shared mount of its
			// own, as ip-netns(8) does.
			_ = unix.Unmount(d, 0)
			_ = os.Remove(d)
		}
	}
	return left
}

func TestNetwork_Bridge(t *testing.T) {
	requireCSI(t)
	for _, cmd := range []string{"iptables", "ip"} {
		if _, err := exec.LookPath(cmd); err != nil {
			t.Skipf("bridge networking needs %s on the host (make deps installs it)", cmd)
		}
	}
	csiBin(t, "netprobe")
	// The agent's chroot_env binds the CSI binaries' directory there.
	probe := filepath.Join(TaskCSIBinDir, "netprobe")
	root, err := RepoRoot()
	must.NoError(t, err)
	cniDir := filepath.Join(root, "build", "cni")
	for _, p := range []string{"bridge", "firewall", "host-local", "loopback", "portmap"} {
		if _, err := os.Stat(filepath.Join(cniDir, p)); err != nil {
			t.Fatalf("no CNI plugin %s in %s: run make csi-tools: %v", p, cniDir, err)
		}
	}

	// A bridge and a /24 of the case's own.
	pid := os.Getpid()
	bridge := fmt.Sprintf("ncsi%d", pid%100000)
	subnet := netip.MustParsePrefix(fmt.Sprintf("172.26.%d.0/24", 64+pid%64))
	before, err := readNetState()
	must.NoError(t, err, must.Sprint("the host's network state before the case"))
	// Registered before the agent's Close, so it runs after it.
	t.Cleanup(func() {
		if left := restoreNetwork(before, bridge); len(left) > 0 {
			t.Logf("removed what the agent left of its network:\n  %s", strings.Join(left, "\n  "))
		}
		after, err := readNetState()
		if err != nil {
			t.Errorf("failed to read the host's network state after clean-up: %v", err)
		}
		if after.ipForward != before.ipForward {
			t.Errorf("ip_forward is %q after clean-up, was %q", after.ipForward, before.ipForward)
		}
		for _, table := range []string{"filter", "nat"} {
			if !slices.Equal(before.rules[table], after.rules[table]) {
				t.Errorf("iptables %s rules differ after clean-up:\nbefore: %q\nafter:  %q", table, before.rules[table], after.rules[table])
			}
		}
		if _, err := run("ip", "link", "show", bridge); err == nil {
			t.Errorf("bridge %s is still there after clean-up", bridge)
		}
		for _, d := range netDirs {
			if !before.dirs[d] && after.dirs[d] {
				t.Errorf("%s is still there after clean-up", d)
			}
		}
	})
	a := StartAgent(t, AgentOptions{ClientConfig: fmt.Sprintf(`  cni_path              = %q
  bridge_network_name   = %q
  bridge_network_subnet = %q`, cniDir, bridge, subnet)})

	hostNS, err := os.Readlink("/proc/self/ns/net")
	must.NoError(t, err)
	readAlloc := func(t *testing.T, id string) *Allocation {
		t.Helper()
		al := a.Allocation(t, id)
		must.NotNil(t, al.NetworkStatus, must.Sprint("the allocation has no network status"))
		must.NotNil(t, al.AllocatedResources, must.Sprint("the allocation has no allocated resources"))
		return al
	}

	// (a) A task of a bridge group sees the group's network only: lo and
	// eth0 in /sys, an address of the bridge's subnet, the dns block's
	// resolver configuration.
	t.Run("task_sees_group_network", func(t *testing.T) {
		job := a.RunJob(t, "net-bridge", nil)
		al := a.WaitAlloc(t, job.ID, startTimeout, StatusComplete)
		out := netLines(a.AllocLogs(t, al.ID, "t", false))
		t.Logf("task output: %v", out)
		must.Eq(t, "eth0 lo", out["devices"])
		must.NotEq(t, hostNS, out["netns"])
		addr, err := netip.ParsePrefix(out["eth0"])
		must.NoError(t, err, must.Sprintf("eth0 address %q", out["eth0"]))
		must.True(t, subnet.Contains(addr.Addr()), must.Sprintf("eth0 %s outside the bridge subnet %s", addr, subnet))
		na := readAlloc(t, al.ID)
		must.Eq(t, addr.Addr().String(), na.NetworkStatus.Address)
		must.Eq(t, "nameserver 192.0.2.53;search ncsi.example;", out["resolv"])
	})

	// (b) A service group in bridge mode and clients of it.
	srvJob := a.RunJob(t, "net-server", map[string]string{"Probe": probe})
	srv := a.WaitAlloc(t, srvJob.ID, startTimeout, StatusRunning)
	a.WaitLogs(t, srv.ID, "t", "listening 127.0.0.1:8081", startTimeout)
	na := readAlloc(t, srv.ID)
	srvIP := na.NetworkStatus.Address
	must.True(t, subnet.Contains(netip.MustParseAddr(srvIP)))
	var mapped string
	for _, p := range na.AllocatedResources.Shared.Ports {
		if p.Label == "http" {
			mapped = net.JoinHostPort(p.HostIP, fmt.Sprint(p.Value))
			must.Eq(t, 8080, p.To)
		}
	}
	must.NotEq(t, "", mapped, must.Sprint("the server has no http port"))
	hostSvc := netHostListener(t)
	agentHTTP := strings.TrimPrefix(a.Addr, "http://")
	srvAll := net.JoinHostPort(srvIP, "8080")
	srvLo := net.JoinHostPort(srvIP, "8081")
	t.Logf("server %s: mapped %s -> 8080; host service %s; agent %s", srvIP, mapped, hostSvc, agentHTTP)

	t.Run("host_reaches_server_through_mapped_port", func(t *testing.T) {
		// Nomad's port mapping leads into the group's namespace; the
		// group's loopback-only listener is out of the host's reach.
		must.Eq(t, "ok server", netDial(mapped))
		must.StrHasPrefix(t, "fail", netDial(srvLo))
	})

	dialFrom := func(t *testing.T, mode string, addrs ...string) map[string]string {
		t.Helper()
		quoted := make([]string, len(addrs))
		for i, s := range addrs {
			quoted[i] = fmt.Sprintf("%q", s)
		}
		job := a.RunJob(t, "net-client", map[string]string{"Probe": probe, "Mode": mode, "Addrs": strings.Join(quoted, ", ")})
		al := a.WaitAlloc(t, job.ID, startTimeout, StatusComplete)
		out := netLines(a.AllocLogs(t, al.ID, "t", false))
		t.Logf("%s client: %v", mode, out)
		return out
	}

	t.Run("bridge_client_reaches_server_only_through_nomads_network", func(t *testing.T) {
		out := dialFrom(t, "bridge", srvAll, srvLo, "127.0.0.1:8081", hostSvc, agentHTTP)
		// The server's address on the bridge Nomad gave both groups.
		must.Eq(t, "ok server", out[srvAll])
		// Not the server's own loopback: by its address, or by 127.0.0.1,
		// which is the client's own loopback.
		must.Eq(t, "fail refused", out[srvLo])
		must.Eq(t, "fail refused", out["127.0.0.1:8081"])
		// Nor anything on the host's loopback: a service there, or the
		// Nomad agent's API.
		must.Eq(t, "fail refused", out[hostSvc])
		must.Eq(t, "fail refused", out[agentHTTP])
	})

	t.Run("host_client_control", func(t *testing.T) {
		// The same probes from the host's network: the host's loopback
		// services answer, so the refusals above come from the bridge
		// group's namespace, not from the probe.
		out := dialFrom(t, "host", hostSvc, srvLo)
		must.Eq(t, "ok host", out[hostSvc])
		must.StrHasPrefix(t, "fail", out[srvLo])
	})

	// (c) nomad alloc exec runs in the group's network namespace: the same
	// devices, and the server's loopback-only listener answers.
	t.Run("alloc_exec_joins_group_network", func(t *testing.T) {
		out, err := a.AllocExec(srv.ID, "t", "/bin/sh", "-c", `echo "devices=$(ls /sys/class/net | tr '\n' ' ')"; `+probe+` dial 127.0.0.1:8081`)
		must.NoError(t, err, must.Sprint(out))
		lines := netLines(out)
		must.Eq(t, "eth0 lo", lines["devices"])
		must.Eq(t, "ok server", lines["127.0.0.1:8081"])
	})

	// Stopping the job tears the group's network down: no namespace file,
	// no link on the bridge.
	t.Run("stop_tears_network_down", func(t *testing.T) {
		a.StopJob(t, srvJob.ID)
		a.WaitAllocID(t, srv.ID, endTimeout, StatusComplete)
		deadline := time.Now().Add(endTimeout)
		for {
			_, nsErr := os.Stat(filepath.Join("/var/run/netns", srv.ID))
			links, _ := run("ip", "-o", "link", "show", "master", bridge)
			if os.IsNotExist(nsErr) && strings.TrimSpace(links) == "" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the server's network is still there %v after it stopped: netns %v, links on %s: %s", endTimeout, nsErr, bridge, links)
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
}
