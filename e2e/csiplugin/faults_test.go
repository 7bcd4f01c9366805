package main

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestParseFaultRules(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []faultRule
		wantErr string
	}{
		{name: "empty", in: "\n# comment\n\n"},
		{name: "hang", in: "NodeStageVolume vol-1 hang",
			want: []faultRule{{text: "NodeStageVolume vol-1 hang", method: "NodeStageVolume", volume: "vol-1", hang: true}}},
		{name: "fail by name", in: "* data fail Unavailable",
			want: []faultRule{{text: "* data fail Unavailable", method: "*", volume: "data", code: codes.Unavailable}}},
		{name: "fail n times by number", in: "  CreateVolume * fail 8 2  ",
			want: []faultRule{{text: "CreateVolume * fail 8 2", method: "CreateVolume", volume: "*", code: codes.ResourceExhausted, times: 2}}},
		{name: "unknown action", in: "NodeStageVolume * explode", wantErr: "want METHOD VOLUME hang|fail CODE [N]"},
		{name: "too short", in: "NodeStageVolume hang", wantErr: "want METHOD VOLUME"},
		{name: "bad code", in: "NodeStageVolume * fail Nope", wantErr: "CODE must be a gRPC error code"},
		{name: "ok is no failure", in: "NodeStageVolume * fail OK", wantErr: "CODE must be a gRPC error code"},
		{name: "bad count", in: "NodeStageVolume * fail Internal 0", wantErr: "N must be a positive number"},
		{name: "hang takes no code", in: "NodeStageVolume * hang Internal", wantErr: "want METHOD VOLUME"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseFaultRules(tt.in)
			if tt.wantErr != "" {
				must.ErrorContains(t, err, tt.wantErr)
				return
			}
			must.NoError(t, err)
			must.True(t, reflect.DeepEqual(tt.want, got), must.Sprintf("got %+v, want %+v", got, tt.want))
		})
	}
}

func TestFaultRuleMatches(t *testing.T) {
	tests := []struct {
		rule             string
		method, id, name string
		want             bool
	}{
		{"NodeStageVolume vol-1 hang", "NodeStageVolume", "vol-1", "", true},
		{"NodeStageVolume vol-1 hang", "NodePublishVolume", "vol-1", "", false},
		{"NodeStageVolume data hang", "NodeStageVolume", "vol-9", "my-data-1", true},
		{"NodeStageVolume data hang", "NodeStageVolume", "vol-9", "other", false},
		{"* data hang", "CreateVolume", "", "data", true},
		{"* * hang", "ControllerUnpublishVolume", "vol-2", "", true},
		// Calls without a volume (those that keep the plugin healthy)
		// are never matched.
		{"* * hang", "Probe", "", "", false},
		{"* * hang", "NodeGetInfo", "", "", false},
		{"NodeGetInfo * hang", "NodeGetInfo", "", "", false}, // no volume
	}
	for _, tt := range tests {
		rules, err := parseFaultRules(tt.rule)
		must.NoError(t, err)
		must.Eq(t, tt.want, rules[0].matches(tt.method, tt.id, tt.name), must.Sprintf("%q on %s %s %s", tt.rule, tt.method, tt.id, tt.name))
	}
}

// A hung call returns once its rule is gone; a fail rule with a count is
// spent after that many calls; no file is no fault.
func TestApplyFaults(t *testing.T) {
	dir := t.TempDir()
	p := &plugin{cfg: config{faults: filepath.Join(dir, "faults")}, faultUses: map[string]int{}}
	ctx := context.Background()
	must.NoError(t, p.applyFaults(ctx, "NodeStageVolume", "vol-1", "data"))

	must.NoError(t, os.WriteFile(p.cfg.faults, []byte("NodeStageVolume data fail Aborted 2\n"), 0o644))
	for i := 0; i < 2; i++ {
		err := p.applyFaults(ctx, "NodeStageVolume", "vol-1", "data")
		must.Eq(t, codes.Aborted, status.Code(err), must.Sprintf("call %d: %v", i, err))
	}
	must.NoError(t, p.applyFaults(ctx, "NodeStageVolume", "vol-1", "data"))

	must.NoError(t, os.WriteFile(p.cfg.faults, []byte("NodePublishVolume * hang\n"), 0o644))
	done := make(chan error, 1)
	go func() { done <- p.applyFaults(ctx, "NodePublishVolume", "vol-1", "data") }()
	select {
	case err := <-done:
		t.Fatalf("a hung call returned before its release: %v", err)
	case <-time.After(5 * faultPoll):
	}
	must.NoError(t, os.Remove(p.cfg.faults))
	must.NoError(t, <-done)

	must.NoError(t, os.WriteFile(p.cfg.faults, []byte("NodePublishVolume * hang\n"), 0o644))
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	must.Eq(t, codes.Canceled, status.Code(p.applyFaults(cctx, "NodePublishVolume", "vol-1", "data")))

	must.NoError(t, os.WriteFile(p.cfg.faults, []byte("NodePublishVolume * sometimes\n"), 0o644))
	must.Eq(t, codes.InvalidArgument, status.Code(p.applyFaults(ctx, "NodePublishVolume", "vol-1", "data")))
}
