package csiclient

import (
	"context"
	"errors"
	"io"
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

// A plugin task that is not privileged controls its socket directory (it
// is bound at mount_dir), so the path the driver dials may be a symlink to
// anyone's socket: another plugin's, the driver's metrics, Nomad's or a
// container runtime's. The peer check refuses the listener before the
// connection carries a byte: no HTTP/2 preface, no call, none of a
// volume's secrets reach the process at the other end.
func TestDial_peerRefusedBeforeAnyByte(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "someone-else.sock")
	lis, err := net.Listen("unix", target)
	must.NoError(t, err)
	link := filepath.Join(dir, "csi.sock")
	must.NoError(t, os.Symlink(target, link))

	type result struct {
		n   int
		err error
	}
	first := make(chan result, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			b := make([]byte, 4096)
			n, rerr := 0, error(nil)
			for {
				k, err := conn.Read(b)
				n += k
				if err != nil {
					if !errors.Is(err, io.EOF) {
						rerr = err
					}
					break
				}
			}
			_ = conn.Close()
			if i == 0 {
				first <- result{n, rerr}
			}
		}
	}()
	t.Cleanup(func() { _ = lis.Close(); <-done })

	c, err := Dial(link, Options{Peer: func(int32) error { return errors.New("not the plugin task's") }})
	must.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", Secrets: map[string]string{"token": "s3cr3t"}})
	must.ErrorContains(t, err, "not the plugin task's")
	must.NoError(t, c.Close())
	r := <-first
	must.NoError(t, r.err)
	must.Eq(t, 0, r.n, must.Sprint("bytes written to a refused listener"))
}
