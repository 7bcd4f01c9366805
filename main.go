// Command nomad-driver-csi is a Nomad task driver plugin. Nomad starts it
// from its plugin_dir; the same binary also serves as each task's
// supervisor, re-executed by the driver, and, run by an operator, as the
// operator's command line (driver/cli).
package main

import (
	"fmt"
	"os"
	"runtime"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins"
	"github.com/hashicorp/nomad/plugins/base"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cli"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/debugstats"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor"
)

// init holds the main thread for main: Go runs init functions and then
// main on the process's first thread, and a goroutine locked to it here
// keeps every other goroutine off it. The driver runs its namespace work
// (a volume re-attached in a task's mount namespace, `nomad alloc exec`
// joining a task's PID, IPC and network namespaces), and a supervisor its
// task's launching thread (which makes the task's mount namespace), on
// goroutines that lock a thread and end without unlocking it, so that the
// runtime ends the thread with the namespaces it joined; the runtime
// cannot end the main thread and would park it instead, in the task's
// namespaces, for the life of the process (TestMainThreadIsMains).
func init() { runtime.LockOSThread() }

func main() {
	// The driver re-executes this binary as a task's supervisor and init
	// stage; those never return from here.
	if supervisor.RunReexec() {
		return
	}
	// Nomad starts plugins with its handshake cookie in the environment;
	// without it, a person runs the binary.
	if os.Getenv(base.Handshake.MagicCookieKey) != base.Handshake.MagicCookieValue {
		os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
	}
	// A debugging aid, off unless the agent's environment names a file.
	stop, err := debugstats.StartFromEnv()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	defer stop()
	plugins.Serve(factory)
}

// factory is what Nomad is served: the driver behind the boundary that
// cleans every error, event and exit message of job text (driver.Boundary).
func factory(logger hclog.Logger) interface{} {
	return driver.NewPlugin(logger).Boundary()
}
