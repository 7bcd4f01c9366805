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

// The kernel's own allocations are masked from a task running as root:
// /proc/slabinfo (the slab caches' fill), /proc/vmallocinfo (the kernel's
// vmalloc areas, their callers and sizes) and /proc/pagetypeinfo (free
// pages by type; reading it holds each zone's lock). Their mode (0400)
// alone guards them. A task whose root is an image has them masked too:
// its /proc is made as a chroot_env task's.
func TestIsolation_KernelAllocationsMasked_Root(t *testing.T) {
	requireTaskRoot(t)
	var files []string
	for _, f := range []string{"slabinfo", "vmallocinfo", "pagetypeinfo"} {
		if _, err := os.Stat("/proc/" + f); err == nil {
			files = append(files, f)
		}
	}
	if len(files) == 0 {
		t.Skip("this kernel has none of /proc/slabinfo, vmallocinfo, pagetypeinfo")
	}
	script := ""
	for _, f := range files {
		script += `echo "` + f + `=$(head -c 64 /proc/` + f + ` 2>/dev/null | wc -c)"` + "\n"
	}
	roots := []struct {
		name string
		spec func(t *testing.T) *testTask
	}{
		{"chroot_env", func(t *testing.T) *testTask { return isolatedSpec(t, script) }},
		{"image", func(t *testing.T) *testTask { return imageSpec(t, script, false) }},
	}
	for _, root := range roots {
		t.Run(root.name, func(t *testing.T) {
			tt := root.spec(t)
			must.Nil(t, tt.spec.Credential, must.Sprint("the task runs as the driver's user, root"))
			got := runLines(t, tt)
			for _, f := range files {
				must.Eq(t, "0", got[f], must.Sprintf("a root task read /proc/%s", f))
			}
		})
	}
}
