package executor

import (
	"os"
	"testing"

	"github.com/shoenig/test/must"
)

// The host's firmware tables are masked from a task running as root:
// /sys/firmware holds the machine's ACPI tables (root's, mode 0400, which
// a root task would read) and memory map, nothing a task needs.
func TestIsolation_FirmwareMasked_Root(t *testing.T) {
	requireTaskRoot(t)
	entries, err := os.ReadDir("/sys/firmware")
	if err != nil || len(entries) == 0 {
		t.Skip("this host's /sys/firmware is empty")
	}
	got := runLines(t, isolatedSpec(t, `
echo "entries=$(ls -A /sys/firmware | wc -l)"
echo "read=$(cat /sys/firmware/acpi/tables/* /sys/firmware/memmap/*/* 2>/dev/null | wc -c)"
if touch /sys/firmware/x 2>/dev/null; then echo firmware=writable; else echo firmware=read-only; fi
`))
	must.Eq(t, "0", got["entries"], must.Sprint("the task lists the host's /sys/firmware"))
	must.Eq(t, "0", got["read"], must.Sprint("the task reads the host's firmware tables"))
	must.Eq(t, "read-only", got["firmware"])
}
