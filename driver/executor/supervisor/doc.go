// Package supervisor is the task side of the executor, the code the shim
// (driver/executor/shim) runs: a small, detached process that sets up a
// mount namespace, control group and capabilities for the task on one OS
// thread of its own, forks the task from that thread as the user asked for,
// reports to the driver, waits for the task and writes its exit status to
// the task's state directory. It also runs the exec stage of `nomad alloc
// exec`. It speaks to the driver only through package wire, and never
// imports the driver side or the Nomad SDK (see the shim's
// TestShimDependencies): there is no RPC to reattach to.
package supervisor
