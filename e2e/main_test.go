//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"sync"
	"testing"
)

// The cases run with driver = "csi". E2E_DRIVER=raw_exec (or exec) runs the
// driver-neutral cases against one of Nomad's own drivers instead, which
// checks the harness itself; the csi-only cases are skipped then.
var testDriver = func() string {
	if d := os.Getenv("E2E_DRIVER"); d != "" {
		return d
	}
	return DriverName
}()

var (
	sharedOnce  sync.Once
	sharedAgent *Agent
	sharedErr   error
)

func TestMain(m *testing.M) {
	root, err := RepoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	if err := CheckPrerequisites(root); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	SweepStale(func(f string, args ...any) { fmt.Fprintf(os.Stderr, f+"\n", args...) })
	if os.Getenv("E2E_SKIP_BUILD") == "" {
		if err := BuildDriver(root); err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	if sharedAgent != nil {
		if code != 0 {
			fmt.Fprintf(os.Stderr, "shared agent log tail (%s):\n%s\n", sharedAgent.LogPath, sharedAgent.LogTail(60))
		}
		sharedAgent.Close()
	}
	os.Exit(code)
}

// shared returns the agent the cases share (csi plugin with
// allow_privileged = false), starting it on first use. A test that fails
// gets the agent's log tail.
func shared(t *testing.T) *Agent {
	t.Helper()
	sharedOnce.Do(func() {
		sharedAgent, sharedErr = NewAgent(AgentOptions{
			Drivers: []string{testDriver},
			Logf:    func(f string, args ...any) { fmt.Fprintf(os.Stderr, "shared agent: "+f+"\n", args...) },
		})
	})
	if sharedErr != nil {
		t.Fatalf("failed to start the shared Nomad agent: %v", sharedErr)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("shared agent log tail (%s):\n%s", sharedAgent.LogPath, sharedAgent.LogTail(40))
		}
	})
	return sharedAgent
}

func requireCSI(t *testing.T) {
	t.Helper()
	if testDriver != DriverName {
		t.Skipf("csi-only case; E2E_DRIVER=%s", testDriver)
	}
}

func vars(kv ...string) map[string]string {
	m := map[string]string{"Driver": testDriver}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}
