package csihook

import (
	"context"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
)

// backoff returns the wait before retry number attempt (0-based): base
// doubled per attempt and capped at max, then jittered down to between half
// and all of it, so that retries of many volumes spread out and never wait
// longer than max.
func backoff(attempt int, base, max time.Duration, rnd func() float64) time.Duration {
	if base <= 0 {
		base = time.Millisecond
	}
	if max < base {
		max = base
	}
	d := max
	if attempt < 62 {
		if v := base << uint(attempt); v > 0 && v < max {
			d = v
		}
	}
	half := d / 2
	return half + time.Duration(rnd()*float64(d-half))
}

// op describes one CSI call for retries, logs and errors. Secrets are only
// used to redact the plugin's message.
type op struct {
	method     string
	taskID     string
	name       string
	pluginID   string
	volumeID   string
	nodeID     string
	path       string
	secrets    []map[string]string
	notFoundOK bool
}

// call runs fn under a deadline of RPCTimeout, retrying with backoff on
// retryable codes up to RetryAttempts times while ctx lasts. NotFound is
// success when o.notFoundOK. A final failure is an *OpError.
func (m *Manager) call(ctx context.Context, o op, fn func(ctx context.Context) error) error {
	for attempt := 0; ; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, m.cfg.RPCTimeout)
		start := time.Now()
		err := fn(cctx)
		cancel()
		code := Code(err)
		if err == nil || (o.notFoundOK && code == codes.NotFound) {
			m.logger.Debug("CSI call done", "method", o.method, "task_id", o.taskID, "plugin_id", o.pluginID,
				"volume_id", o.volumeID, "path", o.path, "code", code.String(), "duration", time.Since(start))
			return nil
		}
		if Retryable(code) && attempt+1 < m.cfg.RetryAttempts && ctx.Err() == nil {
			d := backoff(attempt, m.cfg.RetryBase, m.cfg.RetryMax, rand.Float64)
			m.logger.Warn("CSI call failed, retrying", "method", o.method, "task_id", o.taskID, "plugin_id", o.pluginID,
				"volume_id", o.volumeID, "code", code.String(), "attempt", attempt+1, "backoff", d)
			t := time.NewTimer(d)
			select {
			case <-ctx.Done():
				t.Stop()
				return m.opError(o, err)
			case <-t.C:
			}
			continue
		}
		oe := m.opError(o, err)
		m.logger.Error("CSI call failed", "method", o.method, "task_id", o.taskID, "plugin_id", o.pluginID,
			"volume_id", o.volumeID, "path", o.path, "code", code.String(), "attempts", attempt+1, "error", oe.Message)
		return oe
	}
}

func (m *Manager) opError(o op, err error) *OpError {
	code := Code(err)
	return &OpError{
		Method:   o.method,
		Volume:   o.name,
		VolumeID: o.volumeID,
		PluginID: o.pluginID,
		Code:     code,
		Message:  redact(message(err), o.secrets...),
		Hint:     hint(o.method, code, o.volumeID, o.pluginID, o.nodeID),
	}
}

// unreachable is the OpError for a plugin that cannot be looked up or
// dialled: Unavailable, so teardown keeps retrying until it is back.
func unreachable(o op, msg string) *OpError {
	return &OpError{
		Method: o.method, Volume: o.name, VolumeID: o.volumeID, PluginID: o.pluginID,
		Code: codes.Unavailable, Message: msg,
		Hint: hint(o.method, codes.Unavailable, o.volumeID, o.pluginID, o.nodeID),
	}
}
