package driver

import (
	"errors"

	"github.com/hashicorp/nomad/nomad/structs"
	"google.golang.org/grpc/codes"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
)

// Nomad's task runner restarts a task whose start failed, by the job's
// restart block, only when the driver's error is a structs.Recoverable
// that says so; any other start error fails the task at once. startError
// is the one place StartTask's error becomes one: recoverable when the
// start failed for a passing reason, the error as it is otherwise. Its
// text does not change either way.
func startError(err error) error {
	if err == nil || !passing(err) {
		return err
	}
	return structs.NewRecoverableError(err, true)
}

// passing reports whether a failed start may succeed if started again
// unchanged, by nothing but time (see verdict). When unsure it says no: a
// start retried in vain costs the job its restart attempts and the
// operator the time to read the same error again; a final answer to a
// passing failure costs only an earlier end.
func passing(err error) bool {
	return verdict(err) == causePassing
}

// verdict judges err and every error it holds. A final cause anywhere
// makes the whole final (a volume whose plugin is not running yet beside
// another refused for its namespace is refused). Along one chain of
// wrappers a passing cause is enough: the wrappers only say where it
// happened. Errors joined side by side (errors.Join, fmt.Errorf with
// several %w: a volume setup's checks, the teardown of an earlier start's
// volumes) are failures of their own, and pass only when each of them
// does: one of no known kind beside a plugin restarting is not explained
// by it, and the next start would meet it again.
func verdict(err error) causeKind {
	if err == nil {
		return causeNone
	}
	self := cause(err)
	if self == causeFinal {
		return causeFinal
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		if inner := verdict(u.Unwrap()); inner != causeNone {
			return inner
		}
	case interface{ Unwrap() []error }:
		joined := u.Unwrap()
		all := causePassing
		for _, e := range joined {
			switch verdict(e) {
			case causeFinal:
				return causeFinal
			case causeNone:
				all = causeNone
			}
		}
		if all == causePassing && len(joined) > 0 {
			return causePassing
		}
	}
	return self
}

type causeKind int

const (
	// causeNone is an error that says nothing either way: a wrapper (its
	// causes are looked at on their own) or an error the driver does not
	// know. Alone, or joined beside other failures, it is final (verdict).
	causeNone causeKind = iota
	causePassing
	causeFinal
)

// cause says what kind of cause e, one error of a start's chain, is.
//
// Passing:
//   - a pull whose registry was unreachable, timed out, answered 5xx,
//     408 or 429, or whose image lost a layer to another pull meanwhile,
//     or that waited for the store past image_pull_timeout
//     (image.ErrUnreachable, after the store's own retries);
//   - a CSI call that ended Unavailable or DeadlineExceeded (the plugin
//     restarting, not running on the node, not answering in time),
//     Aborted (CSI's "operation pending for volume": another call for
//     the volume still runs in the plugin) or ResourceExhausted (the
//     node's attach limit or a quota reached, passing once a volume is
//     detached or the quota raised, which the lifecycle does not wait
//     for), after the volume lifecycle's own retries;
//   - a volume's plugin not running or not healthy yet, once plugin_wait
//     is spent (csihook.ErrPluginNotFound);
//   - a single-node-writer volume whose publish for another task of the
//     allocation is being made or undone, or that a task of another
//     allocation is still unpublishing, and a multi-node-single-writer
//     one that another allocation's writer is still unpublishing
//     (csihook.ErrUnsettled);
//   - a volume another operation (another task's stage, publish or
//     teardown of it) held until the setup's deadline, or until the
//     deadline of the teardown of an earlier start of the task that the
//     start waits for (csihook.ErrBusy).
//
// Final: a registry's answer that refuses the request itself (400, 405,
// 410, ...: image.Refused), an image error of any other kind (not found,
// unauthorized, untrusted certificate, digest mismatch, platform, too
// large, not allowed, invalid, store full), a CSI call ended with any
// other code (InvalidArgument, NotFound, PermissionDenied,
// FailedPrecondition, Internal, ..., and Canceled and Unknown, which the
// driver cannot tell apart from a refusal), a volume request that can never work
// (csihook.ErrInvalid), another namespace's volume, a volume in use in a
// way the request cannot share (csihook.ErrConflict but ErrUnsettled),
// root_dir full.
func cause(e error) causeKind {
	switch e := e.(type) {
	case *image.Error:
		if e.Kind == image.ErrUnreachable && !image.Refused(e) {
			return causePassing
		}
		return causeFinal
	case *csihook.OpError:
		switch e.Code {
		case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted:
			return causePassing
		}
		return causeFinal
	case *fullError:
		return causeFinal
	case interface{ Unwrap() error }, interface{ Unwrap() []error }:
		return causeNone
	}
	switch {
	case errors.Is(e, csihook.ErrUnsettled):
		// A conflict too, but one that passes.
		return causePassing
	case errors.Is(e, csihook.ErrInvalid), errors.Is(e, csihook.ErrOtherNamespace), errors.Is(e, csihook.ErrConflict):
		return causeFinal
	case errors.Is(e, csihook.ErrPluginNotFound), errors.Is(e, csihook.ErrBusy):
		return causePassing
	}
	return causeNone
}
