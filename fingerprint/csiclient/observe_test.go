package csiclient

import (
	"context"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestObserve checks that Policy.Observe hears of every attempt with its
// own code and number: a call retried twice and then answered is three
// observations, the first two with the transient code.
func TestObserve(t *testing.T) {
	var got []Observation
	p := Policy{Attempts: 5, Base: time.Microsecond, Max: time.Microsecond,
		Observe: func(o Observation) { got = append(got, o) }}
	calls := 0
	n, err := p.Do(context.Background(), NodeGetVolumeStats, func(context.Context) error {
		calls++
		if calls < 3 {
			return status.Error(codes.Unavailable, "away")
		}
		return nil
	}, nil, nil)
	must.NoError(t, err)
	must.Eq(t, 3, n)
	must.SliceLen(t, 3, got)
	for i, o := range got {
		must.Eq(t, NodeGetVolumeStats, o.Method)
		must.Eq(t, i+1, o.N)
		must.True(t, o.Duration >= 0)
	}
	must.Eq(t, codes.Unavailable, got[0].Code)
	must.Eq(t, codes.Unavailable, got[1].Code)
	must.Eq(t, codes.OK, got[2].Code)

	// A final code is observed once, as it was.
	got = nil
	_, err = p.Do(context.Background(), NodePublishVolume, func(context.Context) error {
		return status.Error(codes.NotFound, "gone")
	}, nil, nil)
	must.Error(t, err)
	must.SliceLen(t, 1, got)
	must.Eq(t, codes.NotFound, got[0].Code)
}
