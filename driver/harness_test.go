package driver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"
	"github.com/hashicorp/nomad/helper/uuid"
	"github.com/hashicorp/nomad/nomad/structs"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"
)

// driverHarness is the driver as Nomad's client reaches it: served in
// this process over Nomad's plugin protocol (go-plugin's gRPC transport,
// with Nomad's driver and base services), and called through the gRPC
// client Nomad's client uses. It also makes the directories Nomad's client
// makes for a task, and reads the task's log FIFOs as Nomad's logmon does.
type driverHarness struct {
	drivers.DriverPlugin
	t    *testing.T
	impl *Driver
}

func newDriverHarness(t *testing.T, d *Driver) *driverHarness {
	t.Helper()
	logger := hclog.New(&hclog.LoggerOptions{Name: "harness", Level: hclog.Warn, Output: io.Discard})
	// Served as main serves it: behind the boundary that cleans what
	// reaches Nomad (boundary.go).
	served := d.Boundary()
	client, server := plugin.TestPluginGRPCConn(t, true, map[string]plugin.Plugin{
		base.PluginTypeDriver: drivers.NewDriverPlugin(served, logger),
		base.PluginTypeBase:   &base.PluginBase{Impl: served},
	})
	t.Cleanup(func() {
		// The server first: the client's Close asks a live server's
		// controller to shut down, which stops the server on a goroutine
		// of its own, beside a Stop here (a race go-plugin does not
		// guard).
		server.Stop()
		_ = client.Close()
	})
	raw, err := client.Dispense(base.PluginTypeDriver)
	must.NoError(t, err)
	return &driverHarness{DriverPlugin: raw.(drivers.DriverPlugin), t: t, impl: d}
}

// Impl is the driver itself, for calls that must not depend on the
// connection (cleanup).
func (h *driverHarness) Impl() *Driver { return h.impl }

// MkAllocDir makes the allocation and task directories Nomad's client
// makes for a task of an image-based driver (alloc/{data,logs,tmp},
// <task>/{local,secrets,tmp}), sets cfg.AllocDir and the environment that
// names them inside the task (the paths the driver binds them to), and,
// with logs, the stdout and stderr FIFOs whose output lands in
// alloc/logs/<task>.stdout.0 and .stderr.0. The returned function stops
// the log readers and removes the directories.
func (h *driverHarness) MkAllocDir(cfg *drivers.TaskConfig, logs bool) func() {
	h.t.Helper()
	allocDir, err := os.MkdirTemp("", "nomad-csi-alloc-")
	must.NoError(h.t, err)
	cfg.AllocDir = allocDir
	td := cfg.TaskDir()
	for _, dir := range []string{
		td.SharedAllocDir, td.LogDir, filepath.Join(td.SharedAllocDir, "data"), filepath.Join(td.SharedAllocDir, "tmp"),
		td.Dir, td.LocalDir, td.SecretsDir, filepath.Join(td.Dir, "tmp"),
	} {
		must.NoError(h.t, os.MkdirAll(dir, 0o777))
		// Past the umask: tasks run as nobody by default.
		must.NoError(h.t, os.Chmod(dir, 0o777))
	}
	if cfg.Env == nil {
		cfg.Env = map[string]string{}
	}
	for k, v := range map[string]string{"NOMAD_ALLOC_DIR": "/alloc", "NOMAD_TASK_DIR": "/local", "NOMAD_SECRETS_DIR": "/secrets"} {
		if _, ok := cfg.Env[k]; !ok {
			cfg.Env[k] = v
		}
	}

	var readers []*logReader
	if logs {
		cfg.StdoutPath = filepath.Join(td.LogDir, "."+cfg.Name+".stdout.fifo")
		cfg.StderrPath = filepath.Join(td.LogDir, "."+cfg.Name+".stderr.fifo")
		for fifo, file := range map[string]string{
			cfg.StdoutPath: filepath.Join(td.LogDir, cfg.Name+".stdout.0"),
			cfg.StderrPath: filepath.Join(td.LogDir, cfg.Name+".stderr.0"),
		} {
			r, err := startLogReader(fifo, file)
			must.NoError(h.t, err)
			readers = append(readers, r)
		}
	}
	return func() {
		for _, r := range readers {
			r.stop()
		}
		if err := os.RemoveAll(allocDir); err != nil {
			h.t.Errorf("remove alloc dir: %v", err)
		}
	}
}

// WaitUntilStarted waits until InspectTask says the task runs.
func (h *driverHarness) WaitUntilStarted(taskID string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		status, err := h.InspectTask(taskID)
		if err != nil {
			return err
		}
		if status.State == drivers.TaskStateRunning {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("task %s is %q after %s, want %q", taskID, status.State, timeout, drivers.TaskStateRunning)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// logReader copies what a task writes to a log FIFO into a file.
type logReader struct {
	fifo *os.File
	done sync.WaitGroup
}

func startLogReader(fifo, file string) (*logReader, error) {
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		return nil, fmt.Errorf("mkfifo %s: %w", fifo, err)
	}
	// Read and write: the open does not wait for a writer, the reader is
	// there before the task's supervisor looks for one, and a writer that
	// closes is no end of file (a recovered task's supervisor writes on).
	f, err := os.OpenFile(fifo, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	out, err := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	r := &logReader{fifo: f}
	r.done.Add(1)
	go func() {
		defer r.done.Done()
		defer out.Close()
		buf := make([]byte, 32<<10)
		for {
			n, err := f.Read(buf)
			if n > 0 {
				_, _ = out.Write(buf[:n])
			}
			if err != nil {
				return
			}
		}
	}()
	return r, nil
}

// stop ends the copy; Close wakes the pending read (FIFOs are polled).
func (r *logReader) stop() {
	_ = r.fifo.Close()
	r.done.Wait()
}

// realTask builds the TaskConfig Nomad's client sends for a task of this
// driver: a fresh allocation, 64 MiB and 100 CPU shares, and tc as the
// task's config block.
func realTask(t testing.TB, name string, tc TaskConfig) *drivers.TaskConfig {
	t.Helper()
	allocID := uuid.Generate()
	cfg := &drivers.TaskConfig{
		ID:      allocID + "/" + name + "/" + uuid.Short(),
		AllocID: allocID,
		Name:    name,
		Resources: &drivers.Resources{
			NomadResources: &structs.AllocatedTaskResources{
				Memory: structs.AllocatedMemoryResources{MemoryMB: 64},
				Cpu:    structs.AllocatedCpuResources{CpuShares: 100},
			},
			LinuxResources: &drivers.LinuxResources{MemoryLimitBytes: 64 << 20, CPUShares: 100},
		},
	}
	must.NoError(t, cfg.EncodeConcreteDriverConfig(&tc))
	return cfg
}

// startTask starts a task and makes sure it is gone when the test ends,
// pass or fail: tasks outlive the driver by design.
func startTask(t *testing.T, h *driverHarness, cfg *drivers.TaskConfig) *drivers.TaskHandle {
	t.Helper()
	handle, _, err := h.StartTask(cfg)
	must.NoError(t, err)
	d := h.Impl()
	t.Cleanup(func() {
		if err := d.DestroyTask(cfg.ID, true); err != nil && !errors.Is(err, drivers.ErrTaskNotFound) {
			t.Logf("cleanup: destroy task %s: %v", cfg.Name, err)
		}
	})
	return handle
}

func waitExit(t *testing.T, h *driverHarness, id string, within time.Duration) *drivers.ExitResult {
	t.Helper()
	ch, err := h.WaitTask(context.Background(), id)
	must.NoError(t, err)
	select {
	case res := <-ch:
		must.NotNil(t, res)
		return res
	case <-time.After(within):
		t.Fatalf("task %s did not exit within %s", id, within)
		return nil
	}
}
