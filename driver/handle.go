package driver

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// taskProcess is what the driver needs of a task's process.
// *executor.Process is the real one; tests use a fake.
type taskProcess interface {
	Pid() int
	State() executor.State
	Wait(ctx context.Context) (*executor.ExitStatus, error)
	Signal(sig syscall.Signal) error
	Shutdown(sig syscall.Signal, grace time.Duration) error
	Kill() error
	Stats() (*cgroups.Stats, error)
	Exec(ctx context.Context, opts executor.ExecOptions) (int, error)
	Destroy() error
	// OnExit has f run once the process has exited (Wait returns at
	// once), or now when it has already; f must not block.
	OnExit(f func())
}

// TaskState is what the driver stores with Nomad for each task, so that it
// can take the task back after a restart. It holds only what recovery needs.
//
// Plugin and Volumes are kept here because the handle Nomad gives back to
// RecoverTask after an agent restart has no driver config to decode: Nomad
// persists the TaskConfig without its (unexported) raw driver config.
type TaskState struct {
	Process   executor.State `json:"process"`
	StartedAt time.Time      `json:"started_at"`
	// Plugin is the task's csi_plugin block, when it serves a CSI plugin.
	Plugin *PluginTaskConfig `json:"plugin,omitempty"`
	// Namespace and JobID are the plugin task's job, which keeps the
	// plugin id across restarts of the driver and of the task.
	Namespace string `json:"namespace,omitempty"`
	JobID     string `json:"job_id,omitempty"`
	// Volumes is set when the task has volume blocks to tear down.
	Volumes bool `json:"volumes,omitempty"`
	// SharedSources are the host paths the task holds as shared mount
	// points, its plugin's stage root included (that mount is the
	// driver's, so it is not among the mounts Nomad stores).
	SharedSources []string `json:"shared_sources,omitempty"`
	// Image is the digest of the task's image (leased in the image store
	// while the task exists). Left out when empty, so that the handle of a
	// task without an image is what earlier builds wrote.
	Image string `json:"image,omitempty" codec:",omitempty"`
	// PinnedBy is the privileged_grant, as the config wrote it, that
	// pins the program of a privileged task (its command or image): no
	// command is exec'd into such a task, after a restart of the driver
	// too. "" for every other task, and for a task started before it was
	// kept; omitted when "", so that other tasks' handles are those of
	// earlier builds byte for byte, and an earlier build that reads a
	// handle with it passes it over.
	PinnedBy string `json:"pinned_by,omitempty" codec:",omitempty"`
	// StopSignal is the STOPSIGNAL of the task's image, which stops the
	// task when its kill_signal is unset (imageStopSignal); omitted when
	// "", as Image.
	StopSignal string `json:"stop_signal,omitempty" codec:",omitempty"`
}

// taskHandle is the driver's view of one task.
type taskHandle struct {
	logger  hclog.Logger
	config  *drivers.TaskConfig
	process taskProcess

	startedAt time.Time
	// sharedSources are the host paths this task holds as shared mount
	// points for its bidirectional mounts.
	sharedSources []string
	// plugin is the task's csi_plugin block, when it serves a CSI plugin.
	plugin *PluginTaskConfig
	// volumes is set when the task has CSI volumes to tear down.
	volumes bool
	// image is the digest of the task's image, leased while it exists.
	image string
	// pinnedBy is TaskState.PinnedBy.
	pinnedBy string
	// stopSignal is TaskState.StopSignal.
	stopSignal string

	// destroyMu serialises DestroyTask calls; destroyed is set once one
	// has released what the task held.
	destroyMu sync.Mutex
	destroyed bool

	// stopping is set once Nomad asked the task to stop: its volumes'
	// teardown is queued, which a plugin's stop waits for (stop_wait).
	stopping atomic.Bool

	// done is closed when the task has exited and exit is set.
	done chan struct{}

	mu          sync.RWMutex
	state       drivers.TaskState
	completedAt time.Time
	exit        *drivers.ExitResult
	// waiters are called once the task has exited (see onExit), by key.
	waiters    map[int]func()
	nextWaiter int
}

func newTaskHandle(logger hclog.Logger, cfg *drivers.TaskConfig, p taskProcess, startedAt time.Time) *taskHandle {
	h := &taskHandle{
		logger:    logger,
		config:    cfg,
		process:   p,
		startedAt: startedAt,
		done:      make(chan struct{}),
		state:     drivers.TaskStateRunning,
	}
	// No goroutine waits for the task: the process says when it ended.
	p.OnExit(h.watch)
	return h
}

// watch records how the process ended, once it has (the process's
// OnExit), and calls the waiters.
func (h *taskHandle) watch() {
	status, err := h.process.Wait(context.Background())
	result := &drivers.ExitResult{}
	completed := time.Now()
	switch {
	case err != nil:
		result.Err = err
		result.ExitCode = -1
	default:
		result.ExitCode = status.ExitCode
		result.Signal = status.Signal
		result.OOMKilled = status.OOMKilled
		switch {
		case status.Err != "":
			result.Err = errorString(status.Err)
		case status.OOMKilled && (status.ExitCode != 0 || status.Signal != 0):
			// What Nomad shows as the exit message in alloc status.
			// A task that exited 0 after the OOM killer ended one of
			// its children succeeded (OOMKilled still says so): Nomad
			// counts an exit with an error as a failure, and exec
			// reports that kill without one.
			result.Err = errorString("OOM Killed")
		case status.PidsLimited > 0 && (status.ExitCode != 0 || status.Signal != 0):
			// A fork or thread refused by the process limit shows in
			// the task only as EAGAIN; say why it may have failed.
			result.Err = errorString(fmt.Sprintf("the task reached its process limit %d times (the driver's pids_limit caps its processes and threads)", status.PidsLimited))
		}
		if !status.ExitedAt.IsZero() {
			completed = status.ExitedAt
		}
	}
	h.mu.Lock()
	h.state = drivers.TaskStateExited
	h.exit = result
	h.completedAt = completed
	waiters := h.waiters
	h.waiters = nil
	close(h.done)
	h.mu.Unlock()
	h.logger.Debug("task exited", "exit_code", result.ExitCode, "signal", result.Signal, "oom_killed", result.OOMKilled)
	for _, f := range waiters {
		f()
	}
}

// waitExit returns a channel that gets the task's exit result (through
// clean, when set) once it has exited, or is closed empty when one of ctxs
// ends first. No goroutine waits for either (a WaitTask per task, for the
// task's whole life, would cost one each): the task's end and the contexts
// call back.
func (h *taskHandle) waitExit(clean func(*drivers.ExitResult) *drivers.ExitResult, ctxs ...context.Context) <-chan *drivers.ExitResult {
	ch := make(chan *drivers.ExitResult, 1)
	var (
		mu       sync.Mutex
		answered bool
		stops    []func()
	)
	answer := func(r *drivers.ExitResult) {
		mu.Lock()
		if answered {
			mu.Unlock()
			return
		}
		answered = true
		pending := stops
		stops = nil
		mu.Unlock()
		for _, stop := range pending {
			stop()
		}
		if r != nil {
			ch <- r
		}
		close(ch)
	}
	// add keeps stop for the answer, or calls it when that came already.
	add := func(stop func()) {
		mu.Lock()
		if answered {
			mu.Unlock()
			stop()
			return
		}
		stops = append(stops, stop)
		mu.Unlock()
	}
	for _, ctx := range ctxs {
		stop := context.AfterFunc(ctx, func() { answer(nil) })
		add(func() { stop() })
	}
	add(h.onExit(func() {
		r := h.exitResult()
		if clean != nil {
			r = clean(r)
		}
		answer(r)
	}))
	return ch
}

// onExit has f called once the task has exited (now, when it has), on the
// goroutine that saw it exit: f must not block. cancel forgets f when it
// was not called yet.
func (h *taskHandle) onExit(f func()) (cancel func()) {
	h.mu.Lock()
	if h.exited() {
		h.mu.Unlock()
		f()
		return func() {}
	}
	if h.waiters == nil {
		h.waiters = map[int]func(){}
	}
	key := h.nextWaiter
	h.nextWaiter++
	h.waiters[key] = f
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		delete(h.waiters, key)
		h.mu.Unlock()
	}
}

func (h *taskHandle) exited() bool {
	select {
	case <-h.done:
		return true
	default:
		return false
	}
}

func (h *taskHandle) exitResult() *drivers.ExitResult {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.exit == nil {
		return nil
	}
	return h.exit.Copy()
}

func (h *taskHandle) status() *drivers.TaskStatus {
	h.mu.RLock()
	defer h.mu.RUnlock()
	st := &drivers.TaskStatus{
		ID:          h.config.ID,
		Name:        h.config.Name,
		State:       h.state,
		StartedAt:   h.startedAt,
		CompletedAt: h.completedAt,
		DriverAttributes: map[string]string{
			"pid": strconv.Itoa(h.process.Pid()),
		},
	}
	if h.exit != nil {
		st.ExitResult = h.exit.Copy()
	}
	return st
}

// errorString is an error whose text was recorded by the supervisor.
type errorString string

func (e errorString) Error() string { return string(e) }

// taskStore holds the handles of the tasks this driver knows.
type taskStore struct {
	mu    sync.RWMutex
	tasks map[string]*taskHandle
}

func newTaskStore() *taskStore { return &taskStore{tasks: map[string]*taskHandle{}} }

func (s *taskStore) Set(id string, h *taskHandle) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tasks[id] = h
}

func (s *taskStore) Get(id string) (*taskHandle, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	h, ok := s.tasks[id]
	return h, ok
}

func (s *taskStore) Delete(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.tasks, id)
}

func (s *taskStore) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.tasks)
}

// execRefused refuses a command exec'd into a task whose grant pins its
// program: it would run as root on the host, outside the pin, and what
// Nomad execs into a task comes from its job (nomad alloc exec, a script
// check, a template's change_script, an action).
func (h *taskHandle) execRefused() error {
	if h.pinnedBy == "" {
		return nil
	}
	return fmt.Errorf("exec into this task is refused: it runs privileged under %s, which pins the program it runs, and a command exec'd into it would run as root on the host (nomad alloc exec, a script check, a template's change_script or an action); read its logs instead, or have the operator grant the job without command or image while it is debugged", h.pinnedBy)
}
