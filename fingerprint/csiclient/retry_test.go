package csiclient

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestRules drives Policy.Do by the table: for every method, each code the
// CSI spec calls transient for it is retried (the call answers on its
// second attempt), and each final code is returned after one attempt.
func TestRules(t *testing.T) {
	final := []codes.Code{codes.Unimplemented, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.FailedPrecondition, codes.PermissionDenied, codes.Internal, codes.OutOfRange, codes.Unknown}
	volumeCalls := []string{CreateVolume, ControllerPublishVolume, ControllerUnpublishVolume, NodeStageVolume,
		NodeUnstageVolume, NodePublishVolume, NodeUnpublishVolume, NodeGetVolumeStats, ControllerExpandVolume, NodeExpandVolume}
	reads := []string{GetPluginInfo, GetPluginCapabilities, Probe, ControllerGetCapabilities, NodeGetCapabilities, NodeGetInfo}
	want := map[string][]codes.Code{}
	for _, m := range volumeCalls {
		want[m] = []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.Aborted, codes.DeadlineExceeded}
	}
	// RESOURCE_EXHAUSTED of these two has a cause the caller must address
	// before retrying (CSI spec): final.
	for _, m := range []string{CreateVolume, ControllerPublishVolume} {
		want[m] = []codes.Code{codes.Unavailable, codes.Aborted, codes.DeadlineExceeded}
	}
	for _, m := range reads {
		want[m] = []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded}
		final = append(final, codes.Aborted)
	}
	must.MapLen(t, len(want), Rules)

	p := Policy{Attempts: 3, Base: time.Microsecond, Max: time.Microsecond}
	for method, retried := range want {
		for _, code := range []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.Aborted,
			codes.DeadlineExceeded, codes.Unimplemented, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
			codes.FailedPrecondition, codes.PermissionDenied, codes.Internal, codes.OutOfRange, codes.Unknown} {
			retry := slices.Contains(retried, code)
			t.Run(method+"/"+code.String(), func(t *testing.T) {
				calls := 0
				n, err := p.Do(context.Background(), method, func(context.Context) error {
					calls++
					if calls == 1 {
						return status.Error(code, "boom")
					}
					return nil
				}, nil, nil)
				if retry {
					must.NoError(t, err)
					must.Eq(t, 2, n)
					must.Eq(t, 2, calls)
				} else {
					must.Eq(t, code, Code(err))
					must.Eq(t, 1, n)
					must.Eq(t, 1, calls)
				}
				must.Eq(t, retry, Retryable(method, code))
			})
		}
	}
}

// TestPolicy_Do covers the loop around the table: attempts run out, done
// turns an error into success, the attempt deadline and its override, and
// a context that ends during the backoff.
func TestPolicy_Do(t *testing.T) {
	unavailable := status.Error(codes.Unavailable, "away")
	t.Run("attempts", func(t *testing.T) {
		var heard []Attempt
		calls := 0
		n, err := Policy{Attempts: 3, Base: time.Microsecond, Max: time.Microsecond}.Do(context.Background(), NodeStageVolume,
			func(context.Context) error { calls++; return unavailable }, nil, func(a Attempt) { heard = append(heard, a) })
		must.ErrorIs(t, err, unavailable)
		must.Eq(t, 3, n)
		must.Eq(t, 3, calls)
		must.SliceLen(t, 2, heard)
		must.Eq(t, 2, heard[1].N)
		must.Eq(t, codes.Unavailable, heard[1].Code)
	})
	t.Run("one attempt", func(t *testing.T) {
		n, err := Policy{}.Do(context.Background(), Probe, func(context.Context) error { return unavailable }, nil, nil)
		must.ErrorIs(t, err, unavailable)
		must.Eq(t, 1, n)
	})
	t.Run("done", func(t *testing.T) {
		notFound := status.Error(codes.NotFound, "gone")
		n, err := Policy{Attempts: 3}.Do(context.Background(), NodeUnpublishVolume, func(context.Context) error { return notFound },
			func(err error) bool { return Code(err) == codes.NotFound }, nil)
		must.NoError(t, err)
		must.Eq(t, 1, n)
	})
	t.Run("deadline", func(t *testing.T) {
		for _, tc := range []struct {
			method  string
			timeout time.Duration
			want    time.Duration
		}{
			{Probe, 0, InfoDeadline},
			{NodeStageVolume, 0, VolumeDeadline},
			{NodeStageVolume, time.Hour, time.Hour},
			{"NoSuchMethod", 0, VolumeDeadline},
		} {
			var got time.Duration
			_, err := Policy{Timeout: tc.timeout}.Do(context.Background(), tc.method, func(ctx context.Context) error {
				dl, ok := ctx.Deadline()
				must.True(t, ok)
				got = time.Until(dl)
				return nil
			}, nil, nil)
			must.NoError(t, err)
			must.Between(t, tc.want-time.Minute/2, got, tc.want)
		}
	})
	t.Run("context ends in backoff", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		n, err := Policy{Attempts: 5, Base: time.Hour, Max: time.Hour}.Do(ctx, NodeStageVolume,
			func(context.Context) error { return unavailable }, nil, func(Attempt) { cancel() })
		must.ErrorIs(t, err, unavailable)
		must.Eq(t, 1, n)
	})
}
