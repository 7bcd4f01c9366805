package driver

import (
	"context"
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"
	cstructs "github.com/hashicorp/nomad/client/structs"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"
	pstructs "github.com/hashicorp/nomad/plugins/shared/structs"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/safetext"
)

// Boundary is the driver as Nomad sees it: every RPC of Driver, with the
// text of everything it hands Nomad passed through the one cleaner
// (csihook/safetext) on the way out. That is each error (a start's, a
// recovery's, a stop's: Nomad shows them in `nomad alloc status` and logs
// them), each task event (message and annotations), each exit result's
// error, and the fingerprint's health description and string attributes.
//
// Job text reaches all of these: a command, a work_dir, a user name, a
// volume's fields, a plugin's messages, and the OS errors that wrap them
// ("stat <path>: ..."). Cleaning at this one boundary, rather than where
// each error is made, keeps an error that a new code path wraps from
// reaching a terminal raw. The driver's log goes through the same cleaner
// (cleanLogger). main serves NewPlugin(logger).Boundary(); the driver's own
// tests may call Driver directly.
type Boundary struct{ d *Driver }

var (
	_ drivers.DriverPlugin            = (*Boundary)(nil)
	_ drivers.ExecTaskStreamingDriver = (*Boundary)(nil)
)

// Boundary returns the driver behind its cleaning boundary.
func (d *Driver) Boundary() *Boundary { return &Boundary{d: d} }

// Driver is the driver behind the boundary.
func (b *Boundary) Driver() *Driver { return b.d }

func (b *Boundary) PluginInfo() (*base.PluginInfoResponse, error) {
	r, err := b.d.PluginInfo()
	return r, safetext.Error(err)
}

func (b *Boundary) ConfigSchema() (*hclspec.Spec, error) {
	s, err := b.d.ConfigSchema()
	return s, safetext.Error(err)
}

func (b *Boundary) SetConfig(c *base.Config) error { return safetext.Error(b.d.SetConfig(c)) }

func (b *Boundary) TaskConfigSchema() (*hclspec.Spec, error) {
	s, err := b.d.TaskConfigSchema()
	return s, safetext.Error(err)
}

func (b *Boundary) Capabilities() (*drivers.Capabilities, error) {
	c, err := b.d.Capabilities()
	return c, safetext.Error(err)
}

func (b *Boundary) Fingerprint(ctx context.Context) (<-chan *drivers.Fingerprint, error) {
	ch, err := b.d.Fingerprint(ctx)
	if err != nil {
		return nil, safetext.Error(err)
	}
	return relay(ctx, ch, cleanFingerprint), nil
}

func (b *Boundary) RecoverTask(h *drivers.TaskHandle) error {
	return safetext.Error(b.d.RecoverTask(h))
}

func (b *Boundary) StartTask(cfg *drivers.TaskConfig) (*drivers.TaskHandle, *drivers.DriverNetwork, error) {
	h, n, err := b.d.StartTask(cfg)
	return h, n, safetext.Error(err)
}

// WaitTask cleans the result where the driver makes it, not through a
// relay: a WaitTask waits for the task's whole life, and a goroutine each
// would cost every running task one (see taskHandle.waitExit).
func (b *Boundary) WaitTask(ctx context.Context, taskID string) (<-chan *drivers.ExitResult, error) {
	ch, err := b.d.waitTask(ctx, taskID, cleanExitResult)
	if err != nil {
		return nil, safetext.Error(err)
	}
	return ch, nil
}

func (b *Boundary) StopTask(taskID string, timeout time.Duration, signal string) error {
	return safetext.Error(b.d.StopTask(taskID, timeout, signal))
}

func (b *Boundary) DestroyTask(taskID string, force bool) error {
	return safetext.Error(b.d.DestroyTask(taskID, force))
}

func (b *Boundary) InspectTask(taskID string) (*drivers.TaskStatus, error) {
	st, err := b.d.InspectTask(taskID)
	if err != nil {
		return nil, safetext.Error(err)
	}
	if st != nil {
		c := *st
		c.ExitResult = cleanExitResult(st.ExitResult)
		c.DriverAttributes = cleanMap(st.DriverAttributes)
		st = &c
	}
	return st, nil
}

func (b *Boundary) TaskStats(ctx context.Context, taskID string, interval time.Duration) (<-chan *cstructs.TaskResourceUsage, error) {
	ch, err := b.d.TaskStats(ctx, taskID, interval)
	return ch, safetext.Error(err)
}

func (b *Boundary) TaskEvents(ctx context.Context) (<-chan *drivers.TaskEvent, error) {
	ch, err := b.d.TaskEvents(ctx)
	if err != nil {
		return nil, safetext.Error(err)
	}
	return relay(ctx, ch, cleanEvent), nil
}

func (b *Boundary) SignalTask(taskID string, signal string) error {
	return safetext.Error(b.d.SignalTask(taskID, signal))
}

func (b *Boundary) ExecTask(taskID string, cmd []string, timeout time.Duration) (*drivers.ExecTaskResult, error) {
	r, err := b.d.ExecTask(taskID, cmd, timeout)
	if err != nil {
		return nil, safetext.Error(err)
	}
	if r != nil {
		// Stdout and stderr are the command's own output, which its
		// caller asked for, as with `nomad alloc logs`.
		c := *r
		c.ExitResult = cleanExitResult(r.ExitResult)
		r = &c
	}
	return r, nil
}

func (b *Boundary) ExecTaskStreaming(ctx context.Context, taskID string, opts *drivers.ExecOptions) (*drivers.ExitResult, error) {
	r, err := b.d.ExecTaskStreaming(ctx, taskID, opts)
	return cleanExitResult(r), safetext.Error(err)
}

// Shutdown stops the driver's background work (see Driver.Shutdown).
func (b *Boundary) Shutdown() { b.d.Shutdown() }

// relay copies what src sends to the channel it returns, through clean,
// until src closes or ctx ends.
func relay[T any](ctx context.Context, src <-chan T, clean func(T) T) <-chan T {
	out := make(chan T)
	go func() {
		defer close(out)
		for v := range src {
			select {
			case out <- clean(v):
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

func cleanFingerprint(fp *drivers.Fingerprint) *drivers.Fingerprint {
	if fp == nil {
		return nil
	}
	c := *fp
	c.HealthDescription = safetext.Clean(fp.HealthDescription)
	c.Err = safetext.Error(fp.Err)
	if len(fp.Attributes) > 0 {
		c.Attributes = make(map[string]*pstructs.Attribute, len(fp.Attributes))
		for k, v := range fp.Attributes {
			if v != nil && v.String != nil && !safetext.IsClean(*v.String) {
				s := safetext.Clean(*v.String)
				a := *v
				a.String = &s
				v = &a
			}
			c.Attributes[safetext.Clean(k)] = v
		}
	}
	return &c
}

func cleanExitResult(r *drivers.ExitResult) *drivers.ExitResult {
	if r == nil || r.Err == nil || safetext.IsClean(r.Err.Error()) {
		return r
	}
	c := *r
	c.Err = safetext.Error(r.Err)
	return &c
}

func cleanEvent(e *drivers.TaskEvent) *drivers.TaskEvent {
	if e == nil {
		return nil
	}
	c := *e
	c.Message = safetext.Clean(e.Message)
	c.Annotations = cleanMap(e.Annotations)
	c.Err = safetext.Error(e.Err)
	return &c
}

func cleanMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[safetext.Clean(k)] = safetext.Clean(v)
	}
	return out
}

// cleanLogger is the driver's logger with every message, key and value
// passed through the one cleaner: Nomad writes a plugin's log lines into
// the agent's log, where a value holding a newline is printed as it is.
// Strings, errors, fmt.Stringers and string slices are cleaned; other
// values (numbers, booleans, durations) cannot carry text.
type cleanLogger struct{ hclog.Logger }

// newCleanLogger wraps l, once.
func newCleanLogger(l hclog.Logger) hclog.Logger {
	if _, ok := l.(cleanLogger); ok {
		return l
	}
	return cleanLogger{l}
}

func (l cleanLogger) Log(level hclog.Level, msg string, args ...interface{}) {
	l.Logger.Log(level, safetext.Clean(msg), cleanArgs(args)...)
}

func (l cleanLogger) Trace(msg string, args ...interface{}) {
	l.Logger.Trace(safetext.Clean(msg), cleanArgs(args)...)
}

func (l cleanLogger) Debug(msg string, args ...interface{}) {
	l.Logger.Debug(safetext.Clean(msg), cleanArgs(args)...)
}

func (l cleanLogger) Info(msg string, args ...interface{}) {
	l.Logger.Info(safetext.Clean(msg), cleanArgs(args)...)
}

func (l cleanLogger) Warn(msg string, args ...interface{}) {
	l.Logger.Warn(safetext.Clean(msg), cleanArgs(args)...)
}

func (l cleanLogger) Error(msg string, args ...interface{}) {
	l.Logger.Error(safetext.Clean(msg), cleanArgs(args)...)
}

func (l cleanLogger) With(args ...interface{}) hclog.Logger {
	return cleanLogger{l.Logger.With(cleanArgs(args)...)}
}

func (l cleanLogger) Named(name string) hclog.Logger {
	return cleanLogger{l.Logger.Named(safetext.Clean(name))}
}

func (l cleanLogger) ResetNamed(name string) hclog.Logger {
	return cleanLogger{l.Logger.ResetNamed(safetext.Clean(name))}
}

func cleanArgs(args []interface{}) []interface{} {
	var out []interface{}
	for i, a := range args {
		c, changed := cleanArg(a)
		if !changed {
			if out != nil {
				out[i] = a
			}
			continue
		}
		if out == nil {
			out = make([]interface{}, len(args))
			copy(out, args[:i])
		}
		out[i] = c
	}
	if out == nil {
		return args
	}
	return out
}

// cleanArg returns a's cleaned text, and whether that differs from a.
func cleanArg(a interface{}) (interface{}, bool) {
	var s string
	switch v := a.(type) {
	case string:
		s = v
	case error:
		if v == nil {
			return a, false
		}
		if safetext.IsClean(v.Error()) {
			return a, false
		}
		return safetext.Error(v), true
	case []string:
		if !slices.ContainsFunc(v, func(e string) bool { return !safetext.IsClean(e) }) {
			return a, false
		}
		out := make([]string, len(v))
		for i, e := range v {
			out[i] = safetext.Clean(e)
		}
		return out, true
	case interface{ String() string }:
		s = v.String()
	default:
		return a, false
	}
	if safetext.IsClean(s) {
		return a, false
	}
	return safetext.Clean(s), true
}
