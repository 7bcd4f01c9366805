package driver

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

func TestCapabilities_network(t *testing.T) {
	must.True(t, capabilities.HasNetIsolationMode(drivers.NetIsolationModeHost))
	must.True(t, capabilities.HasNetIsolationMode(drivers.NetIsolationModeGroup))
	// The driver makes no network itself: Nomad does, as for exec.
	must.False(t, capabilities.HasNetIsolationMode(drivers.NetIsolationModeTask))
	must.False(t, capabilities.MustInitiateNetwork)
}

func TestResolvConf(t *testing.T) {
	const host = "# host\nnameserver 10.0.0.53\nnameserver 10.0.0.54\nsearch corp.example\noptions ndots:2\n"
	cases := []struct {
		name string
		dns  drivers.DNSConfig
		want string
	}{
		{"nothing set copies the host's", drivers.DNSConfig{}, host},
		{"servers only", drivers.DNSConfig{Servers: []string{"1.1.1.1"}},
			"nameserver 1.1.1.1\nsearch corp.example\noptions ndots:2\n"},
		{"everything", drivers.DNSConfig{Servers: []string{"1.1.1.1", "8.8.8.8"}, Searches: []string{"a.example", "b.example"}, Options: []string{"ndots:5", "rotate"}},
			"nameserver 1.1.1.1\nnameserver 8.8.8.8\nsearch a.example b.example\noptions ndots:5 rotate\n"},
		{"searches keep the host's servers", drivers.DNSConfig{Searches: []string{"svc.example"}},
			"nameserver 10.0.0.53\nnameserver 10.0.0.54\nsearch svc.example\noptions ndots:2\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, resolvConf(host, &tc.dns))
		})
	}
}

func TestStartTask_network(t *testing.T) {
	cases := []struct {
		name      string
		net       *drivers.NetworkIsolationSpec
		dns       *drivers.DNSConfig
		ownMount  bool
		wantNetNS string
		// wantDNS is the generated resolv.conf, "" for no mount of it.
		wantDNS string
	}{
		{name: "host network"},
		{name: "group namespace", net: &drivers.NetworkIsolationSpec{Mode: drivers.NetIsolationModeGroup, Path: "/var/run/netns/alloc-1"},
			wantNetNS: "/var/run/netns/alloc-1"},
		{name: "host mode names no namespace", net: &drivers.NetworkIsolationSpec{Mode: drivers.NetIsolationModeHost, Path: "/var/run/netns/x"}},
		{name: "dns block", net: &drivers.NetworkIsolationSpec{Mode: drivers.NetIsolationModeGroup, Path: "/var/run/netns/alloc-1"},
			dns:       &drivers.DNSConfig{Servers: []string{"192.0.2.53"}, Searches: []string{"svc.example"}, Options: []string{"ndots:1"}},
			wantNetNS: "/var/run/netns/alloc-1", wantDNS: "nameserver 192.0.2.53\nsearch svc.example\noptions ndots:1\n"},
		{name: "the job's own resolv.conf wins", dns: &drivers.DNSConfig{Servers: []string{"192.0.2.53"}}, ownMount: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDriver(t, Config{Enabled: true})
			cfg := taskConfig(t, TaskConfig{Command: "/bin/true"})
			cfg.AllocDir = t.TempDir()
			must.NoError(t, os.Mkdir(filepath.Join(cfg.AllocDir, cfg.Name), 0o755))
			cfg.NetworkIsolation, cfg.DNS = tc.net, tc.dns
			if tc.ownMount {
				cfg.Mounts = []*drivers.MountConfig{{TaskPath: "/etc/resolv.conf", HostPath: "/srv/resolv.conf", Readonly: true}}
			}
			_, _, err := d.StartTask(cfg)
			must.NoError(t, err)
			spec := d.started[len(d.started)-1]
			must.Eq(t, tc.wantNetNS, spec.NetNS)
			var got []executor.Mount
			for _, m := range spec.Mounts {
				if m.Target == "/etc/resolv.conf" {
					got = append(got, m)
				}
			}
			switch {
			case tc.ownMount:
				must.Eq(t, []executor.Mount{{Source: "/srv/resolv.conf", Target: "/etc/resolv.conf", ReadOnly: true, Propagation: "private"}}, got)
			case tc.wantDNS == "":
				must.SliceEmpty(t, got)
			default:
				path := filepath.Join(cfg.AllocDir, cfg.Name, "resolv.conf")
				must.Eq(t, []executor.Mount{{Source: path, Target: "/etc/resolv.conf", ReadOnly: true, Propagation: "private"}}, got)
				b, err := os.ReadFile(path)
				must.NoError(t, err)
				must.Eq(t, tc.wantDNS, string(b))
			}
		})
	}
}
