package fingerprint

import (
	"context"
	"maps"
	"sync"
)

// Fake is an in-memory Client. Its answers are the exported fields; a
// non-nil Next*Err field is returned by every call of that method until it
// is cleared. Each call is counted. Change fields while a Prober uses the
// Fake only through Update.
type Fake struct {
	mu sync.Mutex

	Info           PluginInfo
	NotReady       bool
	PluginCaps     PluginCapabilities
	ControllerCaps ControllerCapabilities
	Node           NodeInfo
	NodeCaps       NodeCapabilities
	// Gen is returned by Generation; bump it to pretend the plugin was
	// reconnected to.
	Gen uint64

	NextPluginInfoErr             error
	NextProbeErr                  error
	NextPluginCapabilitiesErr     error
	NextControllerCapabilitiesErr error
	NextNodeInfoErr               error
	NextNodeCapabilitiesErr       error
	NextCloseErr                  error

	PluginInfoCalls             int
	ProbeCalls                  int
	PluginCapabilitiesCalls     int
	ControllerCapabilitiesCalls int
	NodeInfoCalls               int
	NodeCapabilitiesCalls       int
	CloseCalls                  int

	changed chan struct{}
}

var _ Client = (*Fake)(nil)

// NewFake returns a ready Fake answering info for a node plugin.
func NewFake(info PluginInfo, node NodeInfo) *Fake {
	return &Fake{Info: info, Node: node, changed: make(chan struct{}, 1)}
}

// Update changes the Fake's fields under its lock, and then signals
// Changed as a real client does when its connection changes.
func (f *Fake) Update(fn func(f *Fake)) {
	f.mu.Lock()
	fn(f)
	ch := f.changed
	f.mu.Unlock()
	if ch != nil {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// FakeCalls counts the calls made to a Fake, per method.
type FakeCalls struct {
	PluginInfoCalls             int
	ProbeCalls                  int
	PluginCapabilitiesCalls     int
	ControllerCapabilitiesCalls int
	NodeInfoCalls               int
	NodeCapabilitiesCalls       int
	CloseCalls                  int
}

// Calls returns the counters, read under the Fake's lock.
func (f *Fake) Calls() FakeCalls {
	f.mu.Lock()
	defer f.mu.Unlock()
	return FakeCalls{
		PluginInfoCalls:             f.PluginInfoCalls,
		ProbeCalls:                  f.ProbeCalls,
		PluginCapabilitiesCalls:     f.PluginCapabilitiesCalls,
		ControllerCapabilitiesCalls: f.ControllerCapabilitiesCalls,
		NodeInfoCalls:               f.NodeInfoCalls,
		NodeCapabilitiesCalls:       f.NodeCapabilitiesCalls,
		CloseCalls:                  f.CloseCalls,
	}
}

func (f *Fake) PluginInfo(context.Context) (PluginInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.PluginInfoCalls++
	if f.NextPluginInfoErr != nil {
		return PluginInfo{}, f.NextPluginInfoErr
	}
	info := f.Info
	info.Manifest = maps.Clone(info.Manifest)
	return info, nil
}

func (f *Fake) Probe(context.Context) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ProbeCalls++
	if f.NextProbeErr != nil {
		return false, f.NextProbeErr
	}
	return !f.NotReady, nil
}

func (f *Fake) PluginCapabilities(context.Context) (PluginCapabilities, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.PluginCapabilitiesCalls++
	if f.NextPluginCapabilitiesErr != nil {
		return PluginCapabilities{}, f.NextPluginCapabilitiesErr
	}
	return f.PluginCaps, nil
}

func (f *Fake) ControllerCapabilities(context.Context) (ControllerCapabilities, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ControllerCapabilitiesCalls++
	if f.NextControllerCapabilitiesErr != nil {
		return ControllerCapabilities{}, f.NextControllerCapabilitiesErr
	}
	return f.ControllerCaps, nil
}

func (f *Fake) NodeInfo(context.Context) (NodeInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.NodeInfoCalls++
	if f.NextNodeInfoErr != nil {
		return NodeInfo{}, f.NextNodeInfoErr
	}
	info := f.Node
	info.Topology = maps.Clone(info.Topology)
	return info, nil
}

func (f *Fake) NodeCapabilities(context.Context) (NodeCapabilities, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.NodeCapabilitiesCalls++
	if f.NextNodeCapabilitiesErr != nil {
		return NodeCapabilities{}, f.NextNodeCapabilitiesErr
	}
	return f.NodeCaps, nil
}

func (f *Fake) Generation() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.Gen
}

func (f *Fake) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

// Close counts the call and returns NextCloseErr. A closed Fake keeps
// answering, so that a test can hand the same Fake out again on redial.
func (f *Fake) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.CloseCalls++
	return f.NextCloseErr
}
