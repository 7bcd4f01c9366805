package fingerprint

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
)

// A task cannot take an id that a socket in plugin_socket_dirs serves,
// even one whose plugin has not told its name yet; a task reclaiming an id
// it held keeps it over such a socket.
func TestProber_taskCannotShadowSocketDirPlugin(t *testing.T) {
	dir := mkSocketDir(t)
	extSock := filepath.Join(dir, "ext", "csi.sock")
	listen(t, extSock)
	taskSock := filepath.Join(dir, "..", filepath.Base(dir)+"-task.sock")

	d := newFakeDialer()
	ext := NewFake(PluginInfo{Name: "ext"}, NodeInfo{NodeID: "n1"})
	// Its first probes cannot learn its name.
	ext.NextPluginInfoErr = errors.New("starting")
	d.set(extSock, ext)
	d.set(taskSock, NewFake(PluginInfo{Name: "job-plugin"}, NodeInfo{NodeID: "n1"}))
	p := NewProber(Config{Interval: time.Hour, ScanInterval: time.Hour, Dial: d.dial, StatSocket: func(string) error { return nil }})
	defer p.Close()
	p.SetSocketDirs([]string{dir})
	settle(t, p)
	_, ok := p.Get("ext")
	must.False(t, ok, must.Sprint("the socket's name is known before it answered"))

	// SocketServing asks the unnamed socket for its name.
	ext.Update(func(f *Fake) { f.NextPluginInfoErr = nil })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	sock, ok := p.SocketServing(ctx, "ext")
	must.True(t, ok, must.Sprint("the socket that serves the id was not found"))
	must.Eq(t, extSock, sock)
	_, ok = p.SocketServing(ctx, "other")
	must.False(t, ok)

	err := p.Add(PluginSpec{ID: "ext", Type: TypeController, Socket: taskSock, TaskID: "task-1"})
	must.ErrorIs(t, err, ErrServedBySocket)
	must.ErrorContains(t, err, extSock)
	st, ok := p.Get("ext")
	must.True(t, ok)
	must.Eq(t, SourceSocketDir, st.Source, must.Sprint("the task took the socket's id"))

	// A task that held the id before the socket came reclaims it (after a
	// driver restart); the socket is then the conflicting one.
	must.NoError(t, p.Add(PluginSpec{ID: "ext", Type: TypeController, Socket: taskSock, TaskID: "task-1", Reclaim: true}))
	st, _ = p.Get("ext")
	must.Eq(t, SourceTask, st.Source)
	must.Eq(t, "task-1", st.TaskID)
	var conflict string
	for _, s := range p.Snapshot() {
		if s.Socket == extSock {
			conflict = s.Conflict
		}
	}
	must.Eq(t, `plugin id "ext" is already served by task "task-1"`, conflict)
}

// A socket that appears in plugin_socket_dirs while a task serves its id
// does not take it over, neither then nor when the job's next task
// replaces the first one.
func TestProber_laterSocketDoesNotTakeOverTaskID(t *testing.T) {
	dir := mkSocketDir(t)
	taskSock := filepath.Join(dir, "..", filepath.Base(dir)+"-task.sock")
	lateSock := filepath.Join(dir, "late", "csi.sock")
	d := newFakeDialer()
	d.set(taskSock, NewFake(PluginInfo{Name: "hp"}, NodeInfo{NodeID: "n1"}))
	d.set(lateSock, NewFake(PluginInfo{Name: "hp"}, NodeInfo{NodeID: "n1"}))
	p := NewProber(Config{Interval: time.Hour, ScanInterval: time.Hour, Dial: d.dial, StatSocket: func(string) error { return nil }})
	defer p.Close()
	p.SetSocketDirs([]string{dir})
	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: taskSock, TaskID: "task-1"}))

	listen(t, lateSock)
	p.Rescan()
	refresh(t, p)
	st, _ := p.Get("hp")
	must.Eq(t, "task-1", st.TaskID)

	// The next task of the job: without Reclaim it is refused while the
	// first is listed; with it, it replaces the first at once.
	err := p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: taskSock, TaskID: "task-2"})
	must.ErrorContains(t, err, `already served by task "task-1"`)
	must.NoError(t, p.Add(PluginSpec{ID: "hp", Type: TypeNode, Socket: taskSock, TaskID: "task-2", Reclaim: true}))
	st, _ = p.Get("hp")
	must.Eq(t, SourceTask, st.Source)
	must.Eq(t, "task-2", st.TaskID)
}
