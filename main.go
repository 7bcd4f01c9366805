// Command nomad-driver-csi is a Nomad task driver plugin. Nomad starts it
// from its plugin_dir; the same binary also serves as each task's
// supervisor, re-executed by the driver.
package main

import (
	"fmt"
	"os"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/debugstats"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor"
)

func main() {
	// The driver re-executes this binary as a task's supervisor and init
	// stage; those never return from here.
	if supervisor.RunReexec() {
		return
	}
	// A debugging aid, off unless the agent's environment names a file.
	stop, err := debugstats.StartFromEnv()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	defer stop()
	plugins.Serve(func(logger hclog.Logger) interface{} {
		return driver.NewPlugin(logger)
	})
}
