package csiclient

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc"
)

type identity struct {
	csi.UnimplementedIdentityServer
}

func (identity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

// Peer sees the pid of the process listening on the socket before any
// call goes over a connection, and refuses the connection with its error.
func TestDial_peer(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "csi.sock")
	lis, err := net.Listen("unix", socket)
	must.NoError(t, err)
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, identity{})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	var seen atomic.Int32
	refuse := errors.New("not the plugin task's")
	c, err := Dial(socket, Options{Peer: func(pid int32) error { seen.Store(pid); return refuse }})
	must.NoError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Identity.Probe(ctx, &csi.ProbeRequest{})
	must.ErrorContains(t, err, "not the plugin task's")
	must.Eq(t, int32(os.Getpid()), seen.Load())
	must.Eq(t, uint64(0), c.Generation(), must.Sprint("a refused connection is not counted"))

	ok, err := Dial(socket, Options{Peer: func(int32) error { return nil }})
	must.NoError(t, err)
	defer ok.Close()
	_, err = ok.Identity.Probe(ctx, &csi.ProbeRequest{})
	must.NoError(t, err)
}
