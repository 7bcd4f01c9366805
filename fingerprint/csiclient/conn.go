package csiclient

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
)

// Options tune a connection. The zero value is gRPC's own reconnection.
type Options struct {
	// ReconnectMax, when above zero, caps the wait between attempts to
	// reach a plugin that went away, so one that comes back is reachable
	// within it rather than after gRPC's default of up to two minutes.
	ReconnectMax time.Duration
	// ConnectTimeout bounds one attempt to connect (with ReconnectMax).
	ConnectTimeout time.Duration
	// Watch makes Changed signal each change of the connection's state.
	Watch bool
	// Peer, when set, is asked about the process listening on the socket
	// (its pid, as SO_PEERCRED gives it) for each new connection, before
	// any call goes over it: an error refuses the connection.
	Peer func(pid int32) error
}

// Conn is a connection to one plugin socket with the three CSI services.
// It does not connect until the first call, so a plugin that is down shows
// as Unavailable on that call.
type Conn struct {
	Socket     string
	Identity   csi.IdentityClient
	Node       csi.NodeClient
	Controller csi.ControllerClient

	conn    *grpc.ClientConn
	dials   atomic.Uint64
	changed chan struct{}
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// Dial returns a Conn for the unix socket at socket.
func Dial(socket string, o Options) (*Conn, error) {
	c := &Conn{Socket: socket, changed: make(chan struct{}, 1)}
	dialer := func(ctx context.Context, _ string) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", socket)
		if err != nil {
			return nil, err
		}
		if o.Peer != nil {
			if err := checkPeer(conn, o.Peer); err != nil {
				_ = conn.Close()
				return nil, fmt.Errorf("plugin socket %q: %w", socket, err)
			}
		}
		c.dials.Add(1)
		return conn, nil
	}
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(dialer),
	}
	if o.ReconnectMax > 0 {
		opts = append(opts, grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  min(100*time.Millisecond, o.ReconnectMax),
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   o.ReconnectMax,
			},
			MinConnectTimeout: o.ConnectTimeout,
		}))
	}
	conn, err := grpc.NewClient("unix://"+socket, opts...)
	if err != nil {
		return nil, err
	}
	c.conn = conn
	c.Identity = csi.NewIdentityClient(conn)
	c.Node = csi.NewNodeClient(conn)
	c.Controller = csi.NewControllerClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	if o.Watch {
		c.wg.Add(1)
		go c.watch(ctx)
	}
	return c, nil
}

// watch turns connection state changes into a coalesced signal on changed.
func (c *Conn) watch(ctx context.Context) {
	defer c.wg.Done()
	for {
		s := c.conn.GetState()
		if s == connectivity.Shutdown || !c.conn.WaitForStateChange(ctx, s) {
			return
		}
		select {
		case c.changed <- struct{}{}:
		default:
		}
	}
}

// Generation counts the connections established to the socket. When it
// changes between two calls the plugin may have restarted behind it.
func (c *Conn) Generation() uint64 { return c.dials.Load() }

// Changed receives (coalesced) when the connection's state changes; only
// with Options.Watch.
func (c *Conn) Changed() <-chan struct{} { return c.changed }

// Close releases the connection. Calls after Close fail.
func (c *Conn) Close() error {
	c.cancel()
	err := c.conn.Close()
	c.wg.Wait()
	return err
}

// checkPeer asks peer about the process at the other end of a unix
// connection.
func checkPeer(conn net.Conn, peer func(pid int32) error) error {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("not a unix connection (%T)", conn)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if credErr != nil {
		return fmt.Errorf("cannot read the credentials of the process listening: %w", credErr)
	}
	return peer(cred.Pid)
}
