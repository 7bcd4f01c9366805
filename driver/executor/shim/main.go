// Command nomad-driver-csi-shim is the supervisor (and alloc exec stage) of a task
// run by nomad-driver-csi: the executor's stages and nothing else, so it
// starts in a few milliseconds and a few megabytes where the whole driver,
// whose dependencies do a lot at package initialisation, takes tens of
// each. The driver embeds it (make dev) and runs it from root_dir/bin.
package main

import (
	"fmt"
	"os"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor"
)

func main() {
	if supervisor.RunReexec() {
		return
	}
	fmt.Fprintln(os.Stderr, "nomad-driver-csi-shim is started by nomad-driver-csi for each task; it is not run by hand")
	os.Exit(2)
}
