package executor

import (
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// Exactly one of a start that gives up and its supervisor gets the go
// token, whichever comes first, and neither ever waits for it: the
// supervisor's end is a descriptor of the same pipe, as it inherits it.
func TestGoToken(t *testing.T) {
	// supervisorTakes reads the token as the supervisor does (claimGo):
	// one byte, or 0 at the end.
	supervisorTakes := func(t *testing.T, fd int) bool {
		var b [1]byte
		n, err := unix.Read(fd, b[:])
		must.NoError(t, err)
		return n == 1 && b[0] == wire.GoToken
	}
	for _, startFirst := range []bool{true, false} {
		token, err := newGoToken()
		must.NoError(t, err)
		sup, err := unix.Dup(int(token.Fd()))
		must.NoError(t, err)
		if startFirst {
			must.True(t, takeGoToken(token), must.Sprint("a start that gave up first did not get the token"))
			must.False(t, supervisorTakes(t, sup), must.Sprint("the supervisor got the token a start had taken"))
		} else {
			must.True(t, supervisorTakes(t, sup), must.Sprint("the supervisor did not get the token first"))
			must.False(t, takeGoToken(token), must.Sprint("a start took the token its supervisor had"))
		}
		// Taken once, it is gone for both.
		must.False(t, takeGoToken(token))
		must.False(t, supervisorTakes(t, sup))
		_ = unix.Close(sup)
		_ = token.Close()
	}
}
