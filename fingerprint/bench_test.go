package fingerprint

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkProbeRound measures the steady-state fingerprint cost: one
// probe round (Probe on each plugin's kept connection, all plugins in
// parallel) followed by Build over the snapshot, with 1, 10 and 50
// in-process plugin servers on unix sockets. The plugin servers run in the
// same process, so ns/op and allocs/op include their side of each Probe.
func BenchmarkProbeRound(b *testing.B) {
	for _, n := range []int{1, 10, 50} {
		b.Run(fmt.Sprintf("plugins=%d", n), func(b *testing.B) {
			dir := mkSocketDir(b)
			p := NewProber(Config{Interval: time.Hour})
			defer p.Close()
			for i := range n {
				sock := filepath.Join(dir, fmt.Sprintf("p%d.sock", i))
				serve(b, sock, &testPlugin{name: fmt.Sprintf("plugin%d.csi.example.com", i), nodeID: "n1"})
				if err := p.Add(PluginSpec{ID: fmt.Sprintf("plugin%d", i), Type: TypeNode, Socket: sock, TaskID: "t"}); err != nil {
					b.Fatal(err)
				}
			}
			ctx := context.Background()
			// Connect and read every plugin's details once, as at start.
			if err := p.Refresh(ctx); err != nil {
				b.Fatal(err)
			}
			for _, st := range p.Snapshot() {
				if !st.Healthy {
					b.Fatalf("plugin %s is not healthy: %s", st.ID, st.HealthDescription)
				}
			}

			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if err := p.Refresh(ctx); err != nil {
					b.Fatal(err)
				}
				if attrs := Build(p.Snapshot()); len(attrs) == 0 {
					b.Fatal("no attributes")
				}
			}
		})
	}
}

// BenchmarkBuild measures Build alone over 50 plugins that each have node
// and controller services, topology and a max volume count.
func BenchmarkBuild(b *testing.B) {
	plugins := make([]PluginStatus, 50)
	for i := range plugins {
		plugins[i] = PluginStatus{
			ID: fmt.Sprintf("plugin%d.csi.example.com", i), Type: TypeMonolith, Socket: fmt.Sprintf("/csi/p%d.sock", i),
			Source: SourceSocketDir, Healthy: true, Known: true,
			Info:        PluginInfo{Name: "x", VendorVersion: "1"},
			NodeService: true, Node: NodeInfo{NodeID: "n1", MaxVolumes: 8, Topology: map[string]string{"zone": "z1"}},
			ControllerService: true,
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		_ = Build(plugins)
	}
}
