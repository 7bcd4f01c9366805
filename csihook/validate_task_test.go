package csihook

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

// A task's volume blocks are bounded in number and in the bytes they hold
// together: at each limit the request passes, one over is refused before
// any plugin call or record, naming the limit and quoting no secret.
func TestValidate_TaskLimits(t *testing.T) {
	many := func(n int) []VolumeRequest {
		out := make([]VolumeRequest, n)
		for i := range out {
			out[i] = req(fmt.Sprintf("v%d", i), fmt.Sprintf("vol%d", i), fmt.Sprintf("/d%d", i))
		}
		return out
	}
	// n requests holding exactly total bytes together, the last one's
	// secrets making up the rest.
	sized := func(total int) []VolumeRequest {
		reqs := many(2)
		reqs[1].Secrets = nil
		rest := total - requestBytes(reqs[0]) - requestBytes(reqs[1]) - 1
		reqs[1].Secrets = map[string]string{"k": canary + strings.Repeat("x", rest-len(canary))}
		must.Eq(t, total, requestBytes(reqs[0])+requestBytes(reqs[1]))
		return reqs
	}
	for _, tc := range []struct {
		name       string
		ok, tooBig []VolumeRequest
		want       string
	}{
		{"count", many(MaxVolumesPerTask), many(MaxVolumesPerTask + 1),
			"the task has 65 volume blocks: a task may have at most 64"},
		{"bytes", sized(MaxTaskVolumeBytes), sized(MaxTaskVolumeBytes + 1),
			"the task's volume blocks hold 1048577 bytes of names, ids, destinations, mount_options, context, secrets and create.parameters together: they must hold at most 1048576 (1024 KiB)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			must.NoError(t, taskLimits(tc.ok))
			err := validate(tc.tooBig)
			must.ErrorIs(t, err, ErrInvalid)
			must.EqError(t, err, tc.want)
			must.StrNotContains(t, err.Error(), canary)

			h := newHarness(t)
			_, err = h.m.Setup(context.Background(), "t", tc.tooBig)
			must.ErrorContains(t, err, tc.want)
			must.SliceEmpty(t, h.fake.Methods())
			must.SliceEmpty(t, h.journalRecords())
		})
	}
}
