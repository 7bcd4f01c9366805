package cgroups

import (
	"testing"

	"github.com/shoenig/test/must"
)

// BenchmarkHostStats is one stats sample of a real group with a process in
// it, as the driver takes one of every task at each of Nomad's stats
// intervals (root): with the group's files held open between samples, as
// the driver reads them, and with every file opened for each read (the
// limit on held files reached), as it read them before:
//
//	go test -run '^$' -bench HostStats ./driver/cgroups/
func BenchmarkHostStats(b *testing.B) {
	for _, held := range []bool{true, false} {
		name := "opened"
		if held {
			name = "held"
		}
		b.Run(name, func(b *testing.B) {
			if !held {
				old := statBudget
				b.Cleanup(func() { statBudget = old })
				statBudget = &fileBudget{limit: -1}
			}
			g := hostGroup(b, Limits{MemoryBytes: 64 << 20})
			_, run := startIn(b, g, `while :; do sleep 1; done`)
			run()
			// A process joined after it started charges its group only
			// with what it allocates from then on: the loop's first sleep
			// does.
			must.Wait(b, waitFor(func() bool {
				st, err := g.Stats()
				return err == nil && st.MemoryUsage > 0
			}))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				st, err := g.Stats()
				must.NoError(b, err)
				must.Positive(b, st.MemoryUsage)
			}
		})
	}
}
