// Package executor is the driver's side of a task's process, which outlives
// the driver: Start writes the task's spec to its state directory and
// starts a supervisor (the shim, or this binary re-executed; see package
// supervisor) that sets the task up and forks it, Recover finds the
// supervisor again by PID after a restart, Spares keeps supervisors started
// ahead of need, Exec runs `nomad alloc exec`, and Discard ends a start
// that was cut short. What the two sides say to each other (messages, fd
// numbers, file names) is package wire.
package executor
