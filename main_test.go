package main

import (
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
)

// Nomad is served the driver behind its cleaning boundary, never the bare
// driver: errors, events and exit messages carry job text.
func TestFactoryServesTheBoundary(t *testing.T) {
	p := factory(hclog.NewNullLogger())
	b, ok := p.(*driver.Boundary)
	if !ok {
		t.Fatalf("the plugin factory serves %T, want *driver.Boundary", p)
	}
	b.Shutdown()
}
