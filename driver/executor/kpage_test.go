package executor

import (
	"os"
	"testing"

	"github.com/shoenig/test/must"
)

// The kernel's page tables of the node's physical memory are masked from a
// task running as root: /proc/kpageflags and /proc/kpagecount tell the
// state of every page of the host, and /proc/kpagecgroup the control
// group (another allocation's) each page is charged to. The kernel guards
// them with their mode (0400, root's) alone.
func TestIsolation_PhysicalPagesMasked_Root(t *testing.T) {
	requireTaskRoot(t)
	var files []string
	for _, f := range []string{"kpageflags", "kpagecount", "kpagecgroup"} {
		if _, err := os.Stat("/proc/" + f); err == nil {
			files = append(files, f)
		}
	}
	if len(files) == 0 {
		t.Skip("this kernel has none of /proc/kpageflags, kpagecount, kpagecgroup")
	}
	script := ""
	for _, f := range files {
		script += `echo "` + f + `=$(head -c 64 /proc/` + f + ` | wc -c)"` + "\n"
	}
	got := runLines(t, isolatedSpec(t, script))
	for _, f := range files {
		must.Eq(t, "0", got[f], must.Sprintf("a root task read /proc/%s", f))
	}
}
