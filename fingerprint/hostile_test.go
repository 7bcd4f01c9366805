package fingerprint

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/shared/structs"
	"github.com/shoenig/test/must"
)

// A plugin's answers are bounded by gRPC's 4 MiB message only. What it
// says goes into node attributes (sent to the servers with every node
// update), the health description, the agent's log and OnHealthChange (a
// task event): none of these may carry megabytes.
const (
	maxAttrBytes  = 4096 // key + value of any one attribute
	maxAttrsTotal = 64 << 10
	maxAttrCount  = 200
)

// checkAttrsBounded fails unless the attributes are few and small.
func checkAttrsBounded(t *testing.T, attrs map[string]*structs.Attribute) {
	t.Helper()
	must.LessEq(t, maxAttrCount, len(attrs), must.Sprint("attribute count"))
	total := 0
	for k, v := range attrs {
		n := len(k) + len(v.GoString())
		must.LessEq(t, maxAttrBytes, n, must.Sprintf("attribute %.80q", k))
		total += n
	}
	must.LessEq(t, maxAttrsTotal, total, must.Sprint("attributes' total size"))
}

func TestProber_hostileAnswersAreBounded(t *testing.T) {
	huge := strings.Repeat("a", 1<<20)
	manySegments := map[string]string{}
	for i := range 10000 {
		manySegments[fmt.Sprintf("zone%05d", i)] = "z"
	}

	cases := []struct {
		name    string
		mutate  func(f *Fake)
		healthy bool
		// reason, when set, must be in the health description.
		reason string
	}{
		{"name of a megabyte", func(f *Fake) { f.Info.Name = huge }, false, "at most 63"},
		{"vendor_version of a megabyte", func(f *Fake) { f.Info.VendorVersion = huge }, true, ""},
		{"node_id of a megabyte", func(f *Fake) { f.Node.NodeID = huge }, false, "at most 256"},
		{"topology key of a megabyte", func(f *Fake) { f.Node.Topology = map[string]string{huge: "z"} }, false, "topology"},
		{"topology value of a megabyte", func(f *Fake) { f.Node.Topology = map[string]string{"zone": huge} }, false, "topology"},
		{"ten thousand topology segments", func(f *Fake) { f.Node.Topology = manySegments }, false, "topology segments"},
		{"empty topology key", func(f *Fake) { f.Node.Topology = map[string]string{"": "z"} }, false, "topology"},
		{"probe error of a megabyte", func(f *Fake) { f.NextProbeErr = errors.New(huge) }, false, "probe failed"},
		{"capabilities error of a megabyte", func(f *Fake) { f.NextPluginCapabilitiesErr = errors.New(huge) }, false, "aaaa"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := newFakeDialer()
			f := nodeFake()
			tc.mutate(f)
			d.set("/csi/hp.sock", f)
			events := &eventLog{}
			p := newTestProber(t, d, events)
			must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: "/csi/hp.sock", TaskID: "task-1"}))
			settle(t, p)

			st, ok := p.Get("hp")
			must.True(t, ok)
			must.Eq(t, tc.healthy, st.Healthy, must.Sprintf("%.300q", st.HealthDescription))
			must.StrContains(t, st.HealthDescription, tc.reason)
			must.LessEq(t, maxAttrBytes, len(st.HealthDescription))
			for _, e := range events.get() {
				must.LessEq(t, maxAttrBytes, len(e.reason))
			}
			checkAttrsBounded(t, Build(p.Snapshot()))
		})
	}
}

// A socket in plugin_socket_dirs is known by the name it gives: a name
// beyond the CSI spec's 63 characters is no plugin id, ready or not.
func TestProber_discoveredHugeNameIsNoID(t *testing.T) {
	dir := mkSocketDir(t)
	ready := filepath.Join(dir, "ready.sock")
	unready := filepath.Join(dir, "unready.sock")
	listen(t, ready)
	listen(t, unready)
	huge := strings.Repeat("b", 1<<20)

	d := newFakeDialer()
	d.set(ready, NewFake(PluginInfo{Name: huge}, NodeInfo{NodeID: "n1"}))
	nr := NewFake(PluginInfo{Name: huge + "x"}, NodeInfo{NodeID: "n1"})
	nr.NotReady = true
	d.set(unready, nr)
	p := NewProber(Config{Interval: time.Hour, ScanInterval: time.Hour, Dial: d.dial})
	defer p.Close()
	p.SetSocketDirs([]string{dir})
	refresh(t, p)

	for _, st := range p.Snapshot() {
		must.Eq(t, "", st.ID, must.Sprintf("socket %s", st.Socket))
		must.LessEq(t, maxAttrBytes, len(st.HealthDescription))
	}
	checkAttrsBounded(t, Build(p.Snapshot()))
}
