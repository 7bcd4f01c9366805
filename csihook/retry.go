package csihook

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

// backoff is the shared client's capped, jittered backoff; the background
// retries of teardown wait by it too.
var backoff = csiclient.Backoff

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

// internal is an Internal failure of o that the driver found itself (not
// a code the plugin answered), with the message and hint given.
func (o op) internal(message, hint string) *OpError {
	return &OpError{Method: o.method, Volume: o.name, VolumeID: o.volumeID, PluginID: o.pluginID, Code: codes.Internal,
		Message: message, Hint: hint}
}

// teardownMethods are the calls of a volume's teardown.
var teardownMethods = map[string]bool{
	MethodNodeUnpublishVolume: true, MethodNodeUnstageVolume: true, MethodControllerUnpublishVolume: true,
}

// slowCallEvent is how long a teardown call goes unanswered before the
// task hears that the driver is still waiting for it; a variable for
// tests.
var slowCallEvent = 10 * time.Second

// call runs fn under a deadline of RPCTimeout, retrying with backoff on
// the codes csiclient.Rules retries for the method, up to RetryAttempts
// times while ctx lasts. NotFound is success when o.notFoundOK. A final
// failure is an *OpError.
func (m *Manager) call(ctx context.Context, o op, fn func(ctx context.Context) error) error {
	var (
		start   time.Time
		last    error
		retried int
	)
	if o.taskID != "" && teardownMethods[o.method] {
		// A teardown step has no event as it begins (one event tells the
		// whole teardown once it is done): a plugin that does not answer
		// would leave the task's events silent until the call's deadline.
		slow := time.AfterFunc(slowCallEvent, func() {
			m.event(o.taskID, fmt.Sprintf("%s %q: plugin %q has not answered %s for %s; still waiting",
				gerund(o.method), o.name, o.pluginID, o.method, slowCallEvent),
				annotations(o.name, o.pluginID, o.volumeID))
		})
		defer slow.Stop()
	}
	p := csiclient.Policy{Attempts: m.cfg.RetryAttempts, Base: m.cfg.RetryBase, Max: m.cfg.RetryMax, Timeout: m.cfg.RPCTimeout, Code: Code,
		Observe: m.observer(o.pluginID)}
	attempts, err := p.Do(ctx, o.method, func(ctx context.Context) error {
		start = time.Now()
		last = fn(ctx)
		return last
	}, func(err error) bool {
		return o.notFoundOK && Code(err) == codes.NotFound
	}, func(a csiclient.Attempt) {
		retried = a.N
		m.logger.Warn("CSI call failed, retrying", "method", o.method, "task_id", o.taskID, "plugin_id", o.pluginID,
			"volume_id", o.volumeID, "code", a.Code.String(), "attempt", a.N, "backoff", a.Backoff)
	})
	if err == nil {
		m.logger.Debug("CSI call done", "method", o.method, "task_id", o.taskID, "plugin_id", o.pluginID,
			"volume_id", o.volumeID, "path", o.path, "code", Code(last).String(), "duration", time.Since(start))
		return nil
	}
	oe := m.opError(o, err)
	// A call whose context ended while it waited to retry was given up,
	// not failed: whoever ended the context says why.
	if attempts != retried {
		m.logger.Error("CSI call failed", "method", o.method, "task_id", o.taskID, "plugin_id", o.pluginID,
			"volume_id", o.volumeID, "path", o.path, "code", Code(err).String(), "attempts", attempts, "error", oe.Message)
	}
	return oe
}

func (m *Manager) opError(o op, err error) *OpError {
	code := Code(err)
	return &OpError{
		Method:   o.method,
		Volume:   o.name,
		VolumeID: o.volumeID,
		PluginID: o.pluginID,
		Code:     code,
		// A plugin's text (a job may run the plugin): secrets out,
		// controls escaped, bounded, before it reaches an event.
		Message: cleanBounded(message(err), MaxErrorMessage, o.secrets...),
		Hint:    hint(o.method, code, o.volumeID, o.pluginID, o.nodeID),
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
