package driver

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// Networking, as Nomad's exec driver does it: a task runs in the host's
// network, or in its group's network namespace, which Nomad makes itself
// (MustInitiateNetwork is false) for `network { mode = "bridge" }`,
// "none" and "cni/*", and hands over in TaskConfig.NetworkIsolation. The
// driver has no network of its own to make ("driver" mode, task isolation).

// hostResolvConf is the host's resolver configuration, the base of a
// task's generated one.
const hostResolvConf = "/etc/resolv.conf"

// resolvConfTarget is where a task's generated resolver configuration is
// mounted.
const resolvConfTarget = "/etc/resolv.conf"

// taskNetNS is the path of the network namespace the task joins: the
// group's, when Nomad made one; "" keeps the host's network.
func taskNetNS(cfg *drivers.TaskConfig) string {
	if n := cfg.NetworkIsolation; n != nil && n.Mode == drivers.NetIsolationModeGroup {
		return n.Path
	}
	return ""
}

// dnsMount writes the resolver configuration the group's `dns` block (or
// its CNI network) asks for into the task's directory, out of the task's
// reach, and returns its read-only mount at /etc/resolv.conf. What the
// block leaves out comes from the host's configuration at hostPath; with
// nothing set the task gets a copy of it. nil DNS needs no mount.
func dnsMount(cfg *drivers.TaskConfig, hostPath string) (*executor.Mount, error) {
	if cfg.DNS == nil {
		return nil, nil
	}
	host, err := os.ReadFile(hostPath)
	if err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("failed to read the host's resolver configuration %s: %w", hostPath, err)
	}
	content := resolvConf(string(host), cfg.DNS)
	path := filepath.Join(cfg.TaskDir().Dir, "resolv.conf")
	if err := writeFileAtomic(path, []byte(content), 0o644); err != nil {
		return nil, fmt.Errorf("failed to write the task's resolver configuration %s: %w", path, err)
	}
	return &executor.Mount{Source: path, Target: resolvConfTarget, ReadOnly: true, Propagation: executor.PropagationPrivate}, nil
}

// resolvConf is the resolver configuration for dns on a host whose own is
// host: each of dns's servers, searches and options replaces the host's,
// and the host's stand where dns has none.
func resolvConf(host string, dns *drivers.DNSConfig) string {
	if len(dns.Servers) == 0 && len(dns.Searches) == 0 && len(dns.Options) == 0 {
		return host
	}
	var servers, searches, options []string
	sc := bufio.NewScanner(strings.NewReader(host))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		switch fields[0] {
		case "nameserver":
			servers = append(servers, fields[1])
		case "search", "domain":
			// The last of them wins, as for the resolver.
			searches = fields[1:]
		case "options":
			options = append(options, fields[1:]...)
		}
	}
	if len(dns.Servers) > 0 {
		servers = dns.Servers
	}
	if len(dns.Searches) > 0 {
		searches = dns.Searches
	}
	if len(dns.Options) > 0 {
		options = dns.Options
	}
	var b strings.Builder
	for _, s := range servers {
		fmt.Fprintf(&b, "nameserver %s\n", s)
	}
	if len(searches) > 0 {
		fmt.Fprintf(&b, "search %s\n", strings.Join(searches, " "))
	}
	if len(options) > 0 {
		fmt.Fprintf(&b, "options %s\n", strings.Join(options, " "))
	}
	return b.String()
}
