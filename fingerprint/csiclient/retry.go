package csiclient

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Names of the CSI methods, as used in the Rules table, fakes and logs.
const (
	GetPluginInfo             = "GetPluginInfo"
	GetPluginCapabilities     = "GetPluginCapabilities"
	Probe                     = "Probe"
	ControllerGetCapabilities = "ControllerGetCapabilities"
	CreateVolume              = "CreateVolume"
	ControllerPublishVolume   = "ControllerPublishVolume"
	ControllerUnpublishVolume = "ControllerUnpublishVolume"
	NodeGetInfo               = "NodeGetInfo"
	NodeGetCapabilities       = "NodeGetCapabilities"
	NodeStageVolume           = "NodeStageVolume"
	NodeUnstageVolume         = "NodeUnstageVolume"
	NodePublishVolume         = "NodePublishVolume"
	NodeUnpublishVolume       = "NodeUnpublishVolume"
	NodeGetVolumeStats        = "NodeGetVolumeStats"
	ControllerExpandVolume    = "ControllerExpandVolume"
	NodeExpandVolume          = "NodeExpandVolume"
)

// Default deadlines of the Rules table.
const (
	// InfoDeadline bounds the calls that only read what a plugin is: a
	// healthy plugin answers them at once.
	InfoDeadline = 2 * time.Second
	// VolumeDeadline bounds the calls that act on a volume: they mount,
	// format or talk to a storage backend.
	VolumeDeadline = time.Minute
)

// Rule says how one CSI method is retried.
type Rule struct {
	// Retry holds the codes after which the same request may be sent
	// again: the transient ones the CSI spec names for the method.
	Retry []codes.Code
	// Deadline bounds one attempt unless the Policy sets its own.
	Deadline time.Duration
}

var (
	// transient is every code the CSI spec calls retryable: the plugin is
	// away (Unavailable) or busy (ResourceExhausted), another operation on
	// the volume is in flight (Aborted), or the attempt ran out of time
	// (DeadlineExceeded).
	transient = []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.Aborted, codes.DeadlineExceeded}
	// reads are the calls that touch no volume, so Aborted (an operation
	// pending on a volume) is not a transient answer to them.
	reads = []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded}
	// exhaustible are the calls for which the CSI spec gives
	// RESOURCE_EXHAUSTED a meaning that waiting does not change:
	// CreateVolume cannot provision in the requested topology (quota),
	// ControllerPublishVolume finds the node's most volumes attached. The
	// spec says the caller "MUST ensure" the cause is addressed before
	// retrying, so the same request is not sent again at once; the
	// failure goes to the task, whose restart comes later.
	exhaustible = []codes.Code{codes.Unavailable, codes.Aborted, codes.DeadlineExceeded}
)

// Rules is the table of every CSI method this project calls. A code not
// listed for a method is final for it: Unimplemented, InvalidArgument,
// NotFound and AlreadyExists never appear here.
var Rules = map[string]Rule{
	GetPluginInfo:             {Retry: reads, Deadline: InfoDeadline},
	GetPluginCapabilities:     {Retry: reads, Deadline: InfoDeadline},
	Probe:                     {Retry: reads, Deadline: InfoDeadline},
	ControllerGetCapabilities: {Retry: reads, Deadline: InfoDeadline},
	NodeGetCapabilities:       {Retry: reads, Deadline: InfoDeadline},
	NodeGetInfo:               {Retry: reads, Deadline: InfoDeadline},
	CreateVolume:              {Retry: exhaustible, Deadline: VolumeDeadline},
	ControllerPublishVolume:   {Retry: exhaustible, Deadline: VolumeDeadline},
	ControllerUnpublishVolume: {Retry: transient, Deadline: VolumeDeadline},
	NodeStageVolume:           {Retry: transient, Deadline: VolumeDeadline},
	NodeUnstageVolume:         {Retry: transient, Deadline: VolumeDeadline},
	NodePublishVolume:         {Retry: transient, Deadline: VolumeDeadline},
	NodeUnpublishVolume:       {Retry: transient, Deadline: VolumeDeadline},
	NodeGetVolumeStats:        {Retry: transient, Deadline: InfoDeadline},
	ControllerExpandVolume:    {Retry: transient, Deadline: VolumeDeadline},
	NodeExpandVolume:          {Retry: transient, Deadline: VolumeDeadline},
}

// Retryable reports whether a call of method that failed with code may be
// sent again as it was. Unknown methods retry nothing.
func Retryable(method string, code codes.Code) bool {
	for _, c := range Rules[method].Retry {
		if c == code {
			return true
		}
	}
	return false
}

// Deadline returns the table's deadline of one attempt of method;
// VolumeDeadline for a method not in the table.
func Deadline(method string) time.Duration {
	if r, ok := Rules[method]; ok && r.Deadline > 0 {
		return r.Deadline
	}
	return VolumeDeadline
}

// Code returns the gRPC code of err: a status error's code,
// DeadlineExceeded or Canceled for context errors, OK for nil and Unknown
// otherwise.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	if st, ok := status.FromError(err); ok {
		return st.Code()
	}
	return codes.Unknown
}

// Backoff returns the wait before retry number attempt (0-based): base
// doubled per attempt and capped at max, then jittered down to between
// half and all of it, so that retries of many volumes spread out and never
// wait longer than max.
func Backoff(attempt int, base, max time.Duration, rnd func() float64) time.Duration {
	if base <= 0 {
		base = time.Millisecond
	}
	if max < base {
		max = base
	}
	d := max
	if attempt < 62 {
		if v := base << uint(attempt); v > 0 && v < max {
			d = v
		}
	}
	half := d / 2
	return half + time.Duration(rnd()*float64(d-half))
}

// Policy is how one user runs calls under the Rules table.
type Policy struct {
	// Attempts is the most attempts of one call; 1 (or less) never
	// retries, for a user whose own loop is its retry.
	Attempts int
	// Base and Max bound the backoff between attempts.
	Base, Max time.Duration
	// Timeout, when above zero, bounds every attempt instead of the
	// table's deadline: a user with its own bound (the fingerprint's
	// probe timeout, the volume manager's RPCTimeout).
	Timeout time.Duration
	// Rand returns a number in [0, 1) for the jitter; rand.Float64 when
	// nil.
	Rand func() float64
	// Code reads the code of a failed attempt; csiclient.Code when nil. A
	// user whose calls return errors of its own passes its reader.
	Code func(error) codes.Code
	// Observe, when not nil, hears of every attempt once it ended: the
	// method, the attempt's code, how long it took and whether it was a
	// retry (N > 1). It is how metrics count calls without this package
	// knowing of them; it must return quickly.
	Observe func(Observation)
}

// Observation is one finished attempt of a call (see Policy.Observe).
type Observation struct {
	Method   string
	Code     codes.Code
	Duration time.Duration
	// N counts attempts from 1: above 1 the attempt was a retry.
	N int
}

// Attempt describes a failed attempt that will be retried.
type Attempt struct {
	// N counts attempts from 1.
	N       int
	Code    codes.Code
	Backoff time.Duration
}

// Do runs fn under the attempt deadline, and again after a backoff while
// its error has a code the table retries for method, attempts remain and
// ctx lasts. done, when not nil, decides that an error is success (a
// NotFound on teardown); retrying, when not nil, hears of each retry. It
// returns fn's last error (nil on success) and the attempts made.
func (p Policy) Do(ctx context.Context, method string, fn func(ctx context.Context) error,
	done func(error) bool, retrying func(Attempt)) (int, error) {
	timeout := p.Timeout
	if timeout <= 0 {
		timeout = Deadline(method)
	}
	rnd := p.Rand
	if rnd == nil {
		rnd = rand.Float64
	}
	codeOf := p.Code
	if codeOf == nil {
		codeOf = Code
	}
	for attempt := 0; ; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		start := time.Now()
		err := fn(cctx)
		cancel()
		if p.Observe != nil {
			p.Observe(Observation{Method: method, Code: codeOf(err), Duration: time.Since(start), N: attempt + 1})
		}
		if err == nil || (done != nil && done(err)) {
			return attempt + 1, nil
		}
		code := codeOf(err)
		if !Retryable(method, code) || attempt+1 >= p.Attempts || ctx.Err() != nil {
			return attempt + 1, err
		}
		d := Backoff(attempt, p.Base, p.Max, rnd)
		if retrying != nil {
			retrying(Attempt{N: attempt + 1, Code: code, Backoff: d})
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return attempt + 1, err
		case <-t.C:
		}
	}
}
