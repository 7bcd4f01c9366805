package csihook

import (
	"errors"
	"testing"

	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
)

// Every error code a plugin can answer a setup call with comes with what
// to do about it.
func TestHint_EverySetupFailureSaysWhatToDo(t *testing.T) {
	for _, method := range []string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume} {
		for c := codes.Canceled; c <= codes.Unauthenticated; c++ {
			must.NotEq(t, "", hint(method, c, "vol-1", "plug", "node-1"), must.Sprintf("%s answered with %s", method, c))
		}
	}
}

// Only a final answer to NodeStageVolume is a refusal that leaves no
// stage; every outcome the driver cannot know keeps the record staging.
func TestStageRefused(t *testing.T) {
	stage := func(c codes.Code) error {
		return &OpError{Method: MethodNodeStageVolume, Code: c}
	}
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"invalid argument", stage(codes.InvalidArgument), true},
		{"not found", stage(codes.NotFound), true},
		{"already exists", stage(codes.AlreadyExists), true},
		{"failed precondition", stage(codes.FailedPrecondition), true},
		{"permission denied", stage(codes.PermissionDenied), true},
		{"internal", stage(codes.Internal), true},
		{"unimplemented", stage(codes.Unimplemented), true},
		{"joined with a commit failure", errors.Join(stage(codes.NotFound), errors.New("disk full")), true},
		{"unavailable", stage(codes.Unavailable), false},
		{"deadline exceeded", stage(codes.DeadlineExceeded), false},
		{"resource exhausted", stage(codes.ResourceExhausted), false},
		{"aborted", stage(codes.Aborted), false},
		{"canceled", stage(codes.Canceled), false},
		{"unknown", stage(codes.Unknown), false},
		{"another call", &OpError{Method: MethodNodePublishVolume, Code: codes.InvalidArgument}, false},
		{"no call", errors.New("commit failed"), false},
		{"nil", nil, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			must.Eq(t, tc.want, stageRefused(tc.err))
		})
	}
}
