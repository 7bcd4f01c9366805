package main

// Fault rules: a test-only knob the fault suite (e2e/fault_test.go) uses to
// hang or fail a CSI call at the moment the test chooses, across restarts
// of the fixture.
//
// The rules are read from a control file (--faults, default
// <state-dir>/faults) on every call; a missing file means no faults. Each
// line that is neither empty nor a "#" comment is one rule:
//
//	METHOD VOLUME hang
//	METHOD VOLUME fail CODE [N]
//
// METHOD is a CSI method name (NodeStageVolume) or "*" for every
// Controller and Node call that names a volume (never an Identity call,
// NodeGetInfo or a capabilities call, so the plugin stays healthy).
// VOLUME is "*" or a string the call's volume id, or the name the volume
// was created under, contains. The first rule that matches a call applies:
//
//   - hang blocks the call until the rule is gone from the file (the test
//     "releases" it) or the caller gives up; the call then proceeds as
//     usual, or ends with the caller's context error;
//   - fail answers with the gRPC code CODE (a name such as Unavailable, or
//     a number); with N, only the next N calls the rule matches fail, and
//     the rule is spent after that (counted per rule text, in memory: a
//     restarted fixture counts afresh).
//
// A line that cannot be parsed fails the call with InvalidArgument, so a
// typo in a test never passes silently.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// faultRule is one line of the control file.
type faultRule struct {
	text   string
	method string
	volume string
	hang   bool
	code   codes.Code
	times  int // 0: every call
}

// faultPoll is how often a hung call reads the control file again.
const faultPoll = 50 * time.Millisecond

// volumeCall reports whether a method is one a "*" rule matches.
func volumeCall(method string) bool {
	switch method {
	case "NodeGetInfo", "NodeGetCapabilities", "ControllerGetCapabilities", "GetPluginInfo",
		"GetPluginCapabilities", "Probe", "ListVolumes", "GetCapacity":
		return false
	}
	return true
}

func parseFaultRules(data string) ([]faultRule, error) {
	var rules []faultRule
	for i, line := range strings.Split(data, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		r := faultRule{text: line}
		if len(f) < 3 {
			return nil, fmt.Errorf("fault rule %d %q: want METHOD VOLUME hang|fail CODE [N]", i+1, line)
		}
		r.method, r.volume = f[0], f[1]
		switch {
		case f[2] == "hang" && len(f) == 3:
			r.hang = true
		case f[2] == "fail" && (len(f) == 4 || len(f) == 5):
			code, err := parseCode(f[3])
			if err != nil || code == codes.OK {
				return nil, fmt.Errorf("fault rule %d %q: CODE must be a gRPC error code name or number, not %q", i+1, line, f[3])
			}
			r.code = code
			if len(f) == 5 {
				n, err := strconv.Atoi(f[4])
				if err != nil || n <= 0 {
					return nil, fmt.Errorf("fault rule %d %q: N must be a positive number of calls, not %q", i+1, line, f[4])
				}
				r.times = n
			}
		default:
			return nil, fmt.Errorf("fault rule %d %q: want METHOD VOLUME hang|fail CODE [N]", i+1, line)
		}
		rules = append(rules, r)
	}
	return rules, nil
}

func (r faultRule) matches(method, volumeID, name string) bool {
	if r.method != method && (r.method != "*" || !volumeCall(method)) {
		return false
	}
	if r.volume == "*" {
		return volumeID != "" || name != ""
	}
	return (volumeID != "" && strings.Contains(volumeID, r.volume)) || (name != "" && strings.Contains(name, r.volume))
}

// readFaultRules reads the control file; no file is no rule.
func (p *plugin) readFaultRules() ([]faultRule, error) {
	if p.cfg.faults == "" {
		return nil, nil
	}
	b, err := os.ReadFile(p.cfg.faults)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return parseFaultRules(string(b))
}

// matchFault returns the first unspent rule matching the call, counting a
// fail rule's use.
func (p *plugin) matchFault(method, volumeID, name string) (faultRule, bool, error) {
	rules, err := p.readFaultRules()
	if err != nil {
		return faultRule{}, false, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range rules {
		if !r.matches(method, volumeID, name) {
			continue
		}
		if r.times > 0 {
			if p.faultUses[r.text] >= r.times {
				continue
			}
			p.faultUses[r.text]++
		}
		return r, true, nil
	}
	return faultRule{}, false, nil
}

// applyFaults hangs or fails a call as the control file says; nil means
// the call proceeds.
func (p *plugin) applyFaults(ctx context.Context, method, volumeID, name string) error {
	r, ok, err := p.matchFault(method, volumeID, name)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "fault rules in %s: %v", p.cfg.faults, err)
	}
	if !ok {
		return nil
	}
	if !r.hang {
		log.Printf("injected failure method=%s volume_id=%s code=%s rule=%q", method, volumeID, r.code, r.text)
		return status.Errorf(r.code, "injected %s failure of %s", r.code, method)
	}
	log.Printf("hanging method=%s volume_id=%s rule=%q", method, volumeID, r.text)
	t := time.NewTicker(faultPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			log.Printf("hung call given up by the caller method=%s volume_id=%s", method, volumeID)
			return status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
		rules, err := p.readFaultRules()
		if err != nil {
			continue
		}
		held := false
		for _, o := range rules {
			if o.text == r.text {
				held = true
				break
			}
		}
		if !held {
			log.Printf("released method=%s volume_id=%s", method, volumeID)
			return nil
		}
	}
}
