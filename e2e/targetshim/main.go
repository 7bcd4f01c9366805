// Command csi-targetshim runs a CSI plugin that keeps its volumes in memory
// (csi-test's mock driver, gocsi's mock) behind a socket of its own, and
// makes the target path the plugin does not: the CSI spec leaves creating
// target_path to the plugin, and the driver refuses a task whose plugin
// answered NodePublishVolume without it. Every call goes through unchanged
// (its bytes, metadata and status); after a successful NodePublishVolume
// the shim makes the target (a directory, or a file for a block volume),
// and after a successful NodeUnpublishVolume it removes it, as a plugin
// does. It mounts nothing: with it a mock's node calls cost about a socket
// round trip, which is what the many-tasks benchmark needs to measure the
// driver's own share of a teardown.
//
//	CSI_ENDPOINT=unix:///path/csi.sock csi-targetshim PLUGIN [ARG...]
//
// PLUGIN gets CSI_ENDPOINT set to a socket in a temporary directory. The
// shim passes SIGINT and SIGTERM on to it and exits with it.
package main

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

const (
	publish   = "/csi.v1.Node/NodePublishVolume"
	unpublish = "/csi.v1.Node/NodeUnpublishVolume"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "csi-targetshim:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) < 2 {
		return errors.New("usage: csi-targetshim PLUGIN [ARG...]")
	}
	outer, ok := strings.CutPrefix(os.Getenv("CSI_ENDPOINT"), "unix://")
	if !ok || outer == "" {
		return fmt.Errorf("CSI_ENDPOINT %q is not unix://PATH", os.Getenv("CSI_ENDPOINT"))
	}
	dir, err := os.MkdirTemp("", "csishim")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	inner := filepath.Join(dir, "csi.sock")

	cmd := exec.Command(os.Args[1], os.Args[2:]...)
	cmd.Env = append(os.Environ(), "CSI_ENDPOINT=unix://"+inner)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()

	// The plugin's socket first: the driver probes ours as soon as it is
	// there.
	for {
		if _, err := os.Stat(inner); err == nil {
			break
		}
		select {
		case err := <-exited:
			return fmt.Errorf("%s exited before it listened: %v", os.Args[1], err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	conn, err := grpc.NewClient("unix://"+inner, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{})))
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := os.Remove(outer); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	l, err := net.Listen("unix", outer)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ForceServerCodecV2(rawCodec{}), grpc.UnknownServiceHandler(forward(conn)))
	go func() { _ = srv.Serve(l) }()
	err = <-exited
	srv.Stop()
	return err
}

// forward passes one unary call on to the plugin, and makes or removes the
// target after a publish or unpublish that succeeded.
func forward(conn *grpc.ClientConn) grpc.StreamHandler {
	return func(_ any, stream grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(stream)
		var req frame
		if err := stream.RecvMsg(&req); err != nil {
			return err
		}
		ctx := stream.Context()
		if md, ok := metadata.FromIncomingContext(ctx); ok {
			ctx = metadata.NewOutgoingContext(ctx, md)
		}
		var resp frame
		if err := conn.Invoke(ctx, method, &req, &resp); err != nil {
			return err
		}
		if err := handleTarget(method, req); err != nil {
			return err
		}
		return stream.SendMsg(&resp)
	}
}

// handleTarget makes the target of a publish, removes that of an unpublish.
func handleTarget(method string, req frame) error {
	switch method {
	case publish:
		var r csi.NodePublishVolumeRequest
		if err := proto.Unmarshal(req, &r); err != nil {
			return err
		}
		if r.GetVolumeCapability().GetBlock() != nil {
			f, err := os.OpenFile(r.GetTargetPath(), os.O_CREATE|os.O_RDONLY, 0o600)
			if err != nil {
				return err
			}
			return f.Close()
		}
		if err := os.Mkdir(r.GetTargetPath(), 0o750); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	case unpublish:
		var r csi.NodeUnpublishVolumeRequest
		if err := proto.Unmarshal(req, &r); err != nil {
			return err
		}
		if err := os.Remove(r.GetTargetPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// frame is a message's bytes, passed through as they are.
type frame []byte

// rawCodec moves frames without decoding them.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	f, ok := v.(*frame)
	if !ok {
		return nil, fmt.Errorf("csi-targetshim: cannot encode %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(*f)}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	f, ok := v.(*frame)
	if !ok {
		return fmt.Errorf("csi-targetshim: cannot decode into %T", v)
	}
	*f = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }
