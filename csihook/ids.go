package csihook

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// ShortHash is 16 hex characters of the SHA-256 of parts joined by NUL: the
// name of a directory or file kept for an ID that may hold slashes. The
// driver names its task directories by it too, so it must never change.
func ShortHash(parts ...string) string {
	sum := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(sum[:8])
}

// SplitTaskID splits a Nomad task ID into the allocation ID, the task name
// and the invocation: Nomad makes one task ID per start of a task,
// <alloc ID>/<task name>/<invocation>. ok is false for an ID not of exactly
// that form, three parts none of them empty (Nomad refuses '/' in a task
// name, and its allocation IDs and invocations hold none): such an ID names
// no allocation, and its task is taken for a task of no other allocation.
func SplitTaskID(id string) (alloc, task, invocation string, ok bool) {
	alloc, rest, _ := strings.Cut(id, "/")
	task, invocation, _ = strings.Cut(rest, "/")
	if alloc == "" || task == "" || invocation == "" || strings.Contains(invocation, "/") {
		return "", "", "", false
	}
	return alloc, task, invocation, true
}

// allocOf is the allocation of the task of a Nomad task ID, for telling
// whether two tasks are of one allocation. An ID that names no allocation
// (SplitTaskID) is taken for an allocation of its own: the ID behind a
// '/', which no allocation ID SplitTaskID returns holds, so that it
// matches no other task's allocation.
func allocOf(taskID string) string {
	if alloc, _, _, ok := SplitTaskID(taskID); ok {
		return alloc
	}
	return "/" + taskID
}
