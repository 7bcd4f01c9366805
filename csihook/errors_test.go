package csihook

import (
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
