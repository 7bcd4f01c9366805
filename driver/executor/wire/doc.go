// Package wire is the contract between the driver side of the executor
// (driver/executor) and the task's supervisor (driver/executor/supervisor):
// everything both sides read or write. That is the task's Spec (written to
// the state directory by Start, read by the supervisor), the supervisor's
// subcommands and file descriptors, the messages on them (ReadyReport,
// LateMessage, SpareHello, StageConfig), the files in the state directory
// (spec, exit status, supervisor record, log), and the vocabulary both
// check a spec against (capability names, reserved targets).
//
// A driver must be able to recover tasks whose supervisor an older driver
// started: change what is here compatibly (add optional fields, never
// rename or renumber).
package wire
