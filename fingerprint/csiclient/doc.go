// Package csiclient is the one gRPC client of CSI plugin sockets, shared by
// the fingerprint, the volume lifecycle (csihook) and the operator CLI.
//
// It owns three things and nothing more: the connection to a unix socket
// (Dial), the names of the CSI methods, and the table (Rules) that says per
// method which gRPC codes may be retried and under what deadline, with
// Policy.Do running a call under that table with capped, jittered backoff.
// Typed answers and operator-facing errors stay with each user, behind
// small interfaces of its own whose fakes it keeps.
package csiclient
