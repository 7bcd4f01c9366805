//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"text/template"
	"time"

	"github.com/hashicorp/nomad/api"
)

// The e2e suite reads Nomad through its own Go API client
// (github.com/hashicorp/nomad/api): the types below are Nomad's, named as the
// cases have always named them, and the few helpers the cases share hang on
// the two wrappers. The client speaks HTTP/JSON, so it reads every agent of
// the version matrix (make e2e-matrix) alike.

// DriverInfo is a node's view of one driver.
type DriverInfo = api.DriverInfo

// NodeStub is an entry of /v1/nodes.
type NodeStub = api.NodeListStub

// Node is /v1/node/<id>.
type Node = api.Node

// TaskState is a task's state inside an allocation.
type TaskState = api.TaskState

// AllocStub is an entry of /v1/job/<id>/allocations.
type AllocStub = api.AllocationListStub

// TaskEvent is one event of a task, with Text for messages and checks.
type TaskEvent struct{ api.TaskEvent }

// Text is everything an operator could read about the event.
func (e TaskEvent) Text() string {
	parts := []string{e.Type, e.DisplayMessage, e.Message, e.DriverError, e.KillError, e.KillReason,
		e.SetupError, e.ValidationError, e.DriverMessage, e.RestartReason}
	keys := make([]string, 0, len(e.Details))
	for k := range e.Details {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		parts = append(parts, k+"="+e.Details[k])
	}
	var nonEmpty []string
	for _, p := range parts {
		if p != "" {
			nonEmpty = append(nonEmpty, p)
		}
	}
	return strings.Join(nonEmpty, " | ")
}

// Allocation is /v1/allocation/<id>, with helpers for the cases.
type Allocation struct{ api.Allocation }

// Events returns the events of one task ("" for the only task).
func (al *Allocation) Events(task string) []TaskEvent {
	ts := al.Task(task)
	if ts == nil {
		return nil
	}
	out := make([]TaskEvent, 0, len(ts.Events))
	for _, e := range ts.Events {
		if e != nil {
			out = append(out, TaskEvent{*e})
		}
	}
	return out
}

// Task returns one task's state ("" for the only task).
func (al *Allocation) Task(task string) *TaskState {
	if task == "" && len(al.TaskStates) == 1 {
		for _, ts := range al.TaskStates {
			return ts
		}
	}
	return al.TaskStates[task]
}

// Describe renders the allocation's status and events for failure messages.
func (al *Allocation) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "alloc %s (%s): client_status=%s %s desired=%s\n", al.ID, al.Name, al.ClientStatus, al.ClientDescription, al.DesiredStatus)
	names := make([]string, 0, len(al.TaskStates))
	for n := range al.TaskStates {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		ts := al.TaskStates[n]
		fmt.Fprintf(&b, "  task %s: state=%s failed=%v restarts=%d\n", n, ts.State, ts.Failed, ts.Restarts)
		for _, e := range al.Events(n) {
			fmt.Fprintf(&b, "    %s  %s\n", time.Unix(0, e.Time).Format("15:04:05.000"), e.Text())
		}
	}
	return b.String()
}

// apiTimeout bounds one API request (not the event stream, which lives as
// long as the wait that reads it).
const apiTimeout = 15 * time.Second

// setAddr points the agent's API clients at addr (http://127.0.0.1:PORT).
func (a *Agent) setAddr(addr string) error {
	a.Addr = addr
	c, err := api.NewClient(&api.Config{Address: addr, HttpClient: &http.Client{Timeout: Scaled(apiTimeout)}})
	if err != nil {
		return fmt.Errorf("failed to make an API client for %s: %w", addr, err)
	}
	// The event stream's requests last as long as the caller's context.
	s, err := api.NewClient(&api.Config{Address: addr, HttpClient: &http.Client{}})
	if err != nil {
		return fmt.Errorf("failed to make an API client for %s: %w", addr, err)
	}
	a.api, a.stream = c, s
	return nil
}

// API is Nomad's API client for the agent (the server's address in
// Persistent mode and for clients that joined a server).
func (a *Agent) API() *api.Client { return a.api }

// GetJSON decodes the answer to GET path: for what the API client does not
// cover, or a check on the raw JSON an operator would read.
func (a *Agent) GetJSON(path string, out any) error {
	return a.do(http.MethodGet, path, nil, out)
}

// PutJSON sends body as JSON with PUT/POST and decodes the answer.
func (a *Agent) PutJSON(method, path string, body, out any) error {
	return a.do(method, path, body, out)
}

func (a *Agent) do(method, path string, body, out any) error {
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, a.Addr+path, r)
	if err != nil {
		return err
	}
	resp, err := a.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(b)))
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%s %s: failed to decode the answer: %w", method, path, err)
	}
	return nil
}

// Node returns the agent's node.
func (a *Agent) Node(t testing.TB) *Node {
	t.Helper()
	n, err := a.node()
	if err != nil {
		t.Fatalf("%v", err)
	}
	return n
}

func (a *Agent) node() (*Node, error) {
	n, _, err := a.api.Nodes().Info(a.NodeID, nil)
	if err != nil {
		return nil, fmt.Errorf("failed to read node %s: %w", a.NodeID, err)
	}
	return n, nil
}

// JobAllocations lists a job's allocations, newest first.
func (a *Agent) JobAllocations(jobID string) ([]AllocStub, error) {
	stubs, _, err := a.api.Jobs().Allocations(jobID, false, nil)
	if err != nil {
		return nil, fmt.Errorf("failed to list the allocations of job %s: %w", jobID, err)
	}
	allocs := make([]AllocStub, 0, len(stubs))
	for _, s := range stubs {
		allocs = append(allocs, *s)
	}
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].CreateIndex > allocs[j].CreateIndex })
	return allocs, nil
}

// Allocation reads one allocation.
func (a *Agent) Allocation(t testing.TB, allocID string) *Allocation {
	t.Helper()
	al, err := a.allocation(allocID)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return al
}

func (a *Agent) allocation(allocID string) (*Allocation, error) {
	al, _, err := a.api.Allocations().Info(allocID, nil)
	if err != nil {
		return nil, fmt.Errorf("failed to read allocation %s: %w", allocID, err)
	}
	return &Allocation{*al}, nil
}

// ---- jobs ----

// Job is a job the harness submitted.
type Job struct {
	ID   string
	File string // the rendered job file
}

// JobData is what a job template sees.
type JobData struct {
	JobID string
	Vars  map[string]string
}

// RenderJob renders e2e/jobs/<name>.hcl with a new unique job ID and
// returns the job and the path of the rendered file. Vars["Driver"]
// defaults to "csi".
func (a *Agent) RenderJob(name string, vars map[string]string) (Job, error) {
	src := filepath.Join(a.Root, "e2e", "jobs", name+".hcl")
	text, err := os.ReadFile(src)
	if err != nil {
		return Job{}, err
	}
	tmpl, err := template.New(name).Option("missingkey=error").Parse(string(text))
	if err != nil {
		return Job{}, fmt.Errorf("failed to parse job template %s: %w", src, err)
	}
	id := fmt.Sprintf("%s-%s", name, strconv.FormatInt(time.Now().UnixNano()%1e12, 36))
	data := JobData{JobID: id, Vars: map[string]string{"Driver": DriverName}}
	for k, v := range vars {
		data.Vars[k] = v
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, data); err != nil {
		return Job{}, fmt.Errorf("failed to render job template %s: %w", src, err)
	}
	file := filepath.Join(a.Dir, "jobs", id+".hcl")
	if err := os.WriteFile(file, buf.Bytes(), 0o600); err != nil {
		return Job{}, err
	}
	return Job{ID: id, File: file}, nil
}

// SubmitJob renders a job and registers it through the API (the agent
// parses the HCL, as "nomad job run -detach" would have it parsed, without
// starting a CLI process per job) and returns a short answer and the error
// without failing the test; the job is stopped and purged on Close.
func (a *Agent) SubmitJob(t testing.TB, name string, vars map[string]string) (Job, string, error) {
	t.Helper()
	job, err := a.RenderJob(name, vars)
	if err != nil {
		t.Fatalf("%v", err)
	}
	a.mu.Lock()
	a.jobs = append(a.jobs, job.ID)
	a.mu.Unlock()
	out, err := a.registerFile(job.File, nil)
	return job, out, err
}

// registerFile parses a job file with the agent and registers the job; the
// answer names the evaluation, the error what the agent refused.
func (a *Agent) registerFile(file string, w *api.WriteOptions) (string, error) {
	hcl, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	job, err := a.api.Jobs().ParseHCLOpts(&api.JobsParseRequest{JobHCL: string(hcl), Canonicalize: true})
	if err != nil {
		err = fmt.Errorf("failed to parse job file %s: %w", file, err)
		return err.Error(), err
	}
	resp, _, err := a.api.Jobs().Register(job, w)
	if err != nil {
		err = fmt.Errorf("failed to register job file %s: %w", file, err)
		return err.Error(), err
	}
	return "Evaluation ID: " + resp.EvalID, nil
}

// RunJob is SubmitJob that fails the test when the submission fails.
func (a *Agent) RunJob(t testing.TB, name string, vars map[string]string) Job {
	t.Helper()
	job, _, err := a.SubmitJob(t, name, vars)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return job
}

// StopJob stops a job (without purging it, so its allocations stay
// readable). Nomad's scheduler can reconcile the stop's evaluation with
// nothing to stop when a deployment watcher's evaluation of the job is
// planned beside it (seen on a slow guest: the deregistration's
// evaluation stopped 0 allocations, which stayed desired running), so
// the stop is sent again while an allocation that has not finished is
// still desired running; what the driver does with a stop is what the
// callers check.
func (a *Agent) StopJob(t testing.TB, jobID string) {
	t.Helper()
	for try := 0; ; try++ {
		if _, _, err := a.api.Jobs().Deregister(jobID, false, nil); err != nil {
			t.Fatalf("failed to stop job %s: %v", jobID, err)
		}
		if try == 2 {
			return
		}
		deadline := time.Now().Add(Scaled(10 * time.Second))
		for {
			allocs, err := a.JobAllocations(jobID)
			if err != nil {
				t.Fatalf("%v", err)
			}
			running := false
			for _, al := range allocs {
				// A finished allocation keeps "run": it has nothing to
				// stop.
				finished := al.ClientStatus == StatusComplete || al.ClientStatus == StatusFailed || al.ClientStatus == "lost"
				if al.DesiredStatus == "run" && !finished {
					running = true
				}
			}
			if !running {
				return
			}
			if time.Now().After(deadline) {
				t.Logf("job %s: an allocation is still desired running after its stop; stopping it again", jobID)
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}

// Nomad runs the nomad CLI against the agent and returns its combined
// output.
func (a *Agent) Nomad(args ...string) (string, error) {
	return a.NomadContext(context.Background(), args...)
}

// NomadContext is Nomad with a context; a call never runs longer than two
// minutes.
func (a *Agent) NomadContext(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, Scaled(2*time.Minute))
	defer cancel()
	cmd := exec.CommandContext(ctx, NomadBinary(a.Root), args...)
	cmd.Env = append(cleanEnv(), "NOMAD_ADDR="+a.Addr, "NOMAD_CLI_NO_COLOR=1")
	cmd.Stdin = nil
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// allocRecheck is how often a wait reads the allocation again although
// the event stream brought nothing: a change made before the subscription
// took hold cannot hide for longer than this.
const allocRecheck = time.Second

// allocPoll is how often a wait reads the allocation once the event stream
// has failed.
const allocPoll = 200 * time.Millisecond

// streamStats is what a wait's event stream did.
type streamStats struct {
	Events, Batches int64
	Err             error // why the stream broke; nil while it worked
}

func (s streamStats) String() string {
	if s.Err != nil {
		return fmt.Sprintf("the event stream broke after %d events (%v); polled every %v since", s.Events, s.Err, allocPoll)
	}
	return fmt.Sprintf("the event stream brought %d events in %d batches; rechecked every %v", s.Events, s.Batches, allocRecheck)
}

// watchAllocs runs check (given what the stream did so far) at once,
// again after every batch of Allocation events for key (an allocation ID,
// or a job ID: Nomad files an allocation's events under both), and at
// least every allocRecheck, until
// check returns true or timeout passes. Reading the allocation after each
// event, rather than every 200ms, answers as soon as Nomad knows and spares
// the agent the polling. It returns check's last answer and what the event
// stream did, for failure messages.
func (a *Agent) watchAllocs(key string, timeout time.Duration, check func(streamStats) bool) (bool, streamStats) {
	return a.watchAllocsIn("", key, timeout, check)
}

// watchAllocsIn is watchAllocs for a namespace ("" is the default one).
func (a *Agent) watchAllocsIn(ns, key string, timeout time.Duration, check func(streamStats) bool) (bool, streamStats) {
	ctx, cancel := context.WithTimeout(context.Background(), Scaled(timeout))
	defer cancel()
	wake := make(chan struct{}, 1)
	broke := make(chan error, 1)
	var events, batches atomic.Int64
	go func() {
		// An agent that writes nothing before the first event (Nomad
		// 1.10) returns from Stream only then: the checks do not wait
		// for it.
		ch, err := a.stream.EventStream().Stream(ctx, map[api.Topic][]string{api.TopicAllocation: {key}}, 0, &api.QueryOptions{Namespace: ns})
		if err != nil {
			broke <- err
			return
		}
		for evs := range ch {
			if evs.Err != nil {
				broke <- evs.Err
				return
			}
			batches.Add(1)
			events.Add(int64(len(evs.Events)))
			select {
			case wake <- struct{}{}:
			default:
			}
		}
		broke <- errors.New("the stream ended")
	}()
	tick := time.NewTicker(allocRecheck)
	defer tick.Stop()
	var streamErr error
	stats := func() streamStats {
		return streamStats{Events: events.Load(), Batches: batches.Load(), Err: streamErr}
	}
	for {
		if check(stats()) {
			return true, stats()
		}
		select {
		case <-ctx.Done():
			return check(stats()), stats()
		case <-wake:
		case err := <-broke:
			if ctx.Err() != nil {
				// The deadline ended the stream: not a breakage.
				continue
			}
			streamErr = err
			tick.Reset(allocPoll)
		case <-tick.C:
		}
	}
}

// WaitAlloc waits for the job's newest allocation to reach one of the
// wanted client statuses and returns it. It fails the test at once when
// the allocation reaches a terminal status it did not want. It reads the
// allocation when the event stream says it changed (watchAllocs).
func (a *Agent) WaitAlloc(t testing.TB, jobID string, timeout time.Duration, want ...string) *Allocation {
	t.Helper()
	return a.waitAllocStatus(t, "", jobID, "allocation of job "+jobID, timeout, want, func() (*Allocation, error) {
		allocs, err := a.JobAllocations(jobID)
		if err != nil || len(allocs) == 0 {
			return nil, err
		}
		return a.allocation(allocs[0].ID)
	})
}

// WaitAllocID waits for one allocation to reach a wanted client status.
func (a *Agent) WaitAllocID(t testing.TB, allocID string, timeout time.Duration, want ...string) *Allocation {
	t.Helper()
	return a.waitAllocStatus(t, "", allocID, "allocation "+allocID, timeout, want, func() (*Allocation, error) {
		return a.allocation(allocID)
	})
}

// waitAllocStatus is the wait of WaitAlloc and its kin: on every change
// the event stream shows for key (a job or an allocation ID) in namespace
// ns, get reads the allocation (nil while there is none yet), until its
// client status is one of want. It fails the test when the allocation ends
// in another terminal status or time runs out; what names it in messages.
func (a *Agent) waitAllocStatus(t testing.TB, ns, key, what string, timeout time.Duration, want []string, get func() (*Allocation, error)) *Allocation {
	t.Helper()
	var last *Allocation
	var lastErr error
	ok, note := a.watchAllocsIn(ns, key, timeout, func(streamStats) bool {
		al, err := get()
		if err != nil || al == nil {
			lastErr = err
			return false
		}
		last = al
		if slices.Contains(want, al.ClientStatus) {
			return true
		}
		if IsTerminal(al.ClientStatus) {
			t.Fatalf("%s is %s, wanted %v:\n%s", what, al.ClientStatus, want, al.Describe())
		}
		return false
	})
	if ok {
		return last
	}
	if last == nil {
		t.Fatalf("%s was not seen within %v (last error: %v; %s)", what, timeout, lastErr, note)
	}
	t.Fatalf("%s did not become %v within %v (%s); last seen:\n%s", what, want, timeout, note, last.Describe())
	return nil
}

// WaitEvent waits for a task event of the given type and returns it.
func (a *Agent) WaitEvent(t testing.TB, allocID, task, eventType string, timeout time.Duration) TaskEvent {
	t.Helper()
	var last *Allocation
	var found TaskEvent
	ok, note := a.watchAllocs(allocID, timeout, func(streamStats) bool {
		al, err := a.allocation(allocID)
		if err != nil {
			return false
		}
		last = al
		for _, e := range al.Events(task) {
			if e.Type == eventType {
				found = e
				return true
			}
		}
		return false
	})
	if ok {
		return found
	}
	desc := "(allocation unreadable)"
	if last != nil {
		desc = last.Describe()
	}
	t.Fatalf("no %q event for task %q of allocation %s within %v (%s); last seen:\n%s", eventType, task, allocID, timeout, note, desc)
	return TaskEvent{}
}

// AllocLogs reads a task's stdout (or stderr) with "nomad alloc logs".
func (a *Agent) AllocLogs(t testing.TB, allocID, task string, stderr bool) string {
	t.Helper()
	args := []string{"alloc", "logs"}
	if stderr {
		args = append(args, "-stderr")
	}
	args = append(args, allocID, task)
	out, err := a.Nomad(args...)
	if err != nil {
		t.Fatalf("nomad alloc logs %s %s failed: %v\n%s", allocID, task, err, out)
	}
	return out
}

// WaitLogs waits until a task's stdout contains substr and returns it.
func (a *Agent) WaitLogs(t testing.TB, allocID, task, substr string, timeout time.Duration) string {
	t.Helper()
	timeout = Scaled(timeout)
	deadline := time.Now().Add(timeout)
	var out string
	for time.Now().Before(deadline) {
		o, err := a.Nomad("alloc", "logs", allocID, task)
		if err == nil {
			out = o
			if strings.Contains(out, substr) {
				return out
			}
		} else {
			out = o + err.Error()
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("stdout of task %s in allocation %s did not contain %q within %v; it was:\n%s", task, allocID, substr, timeout, out)
	return ""
}

// AllocExec runs a command in a running task with "nomad alloc exec"
// (no TTY, no stdin) and returns its output.
func (a *Agent) AllocExec(allocID, task string, command ...string) (string, error) {
	args := append([]string{"alloc", "exec", "-i=false", "-t=false", "-task", task, allocID}, command...)
	return a.Nomad(args...)
}
