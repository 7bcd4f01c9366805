package driver

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/safetext"
)

// TestBoundary_jobFieldsReachNoTerminalRaw starts real tasks through
// Nomad's gRPC protocol (harness_test.go serves the Boundary, as main), with a
// hostile terminal sequence in each job field whose text a start error
// carries (the command, the work_dir, the user): the error Nomad gets, and
// every event, hold the text escaped, never raw. The OS errors that wrap
// these fields ("stat <path>: ...") carried them raw before.
func TestBoundary_jobFieldsReachNoTerminalRaw(t *testing.T) {
	requireRoot(t)
	h, _ := harnessDriver(t, Config{CgroupParent: "nomad-csi-test-boundary"})
	events := collectEvents(t, h)

	cases := []struct {
		name string
		tc   TaskConfig
		user string
	}{
		{"command", TaskConfig{Command: "/nonexistent/" + hostileText}, ""},
		{"command_in_path", TaskConfig{Command: "cmd" + hostileText}, ""},
		{"work_dir", TaskConfig{Command: "/bin/true", WorkDir: "/nonexistent/" + hostileText}, ""},
		{"user", TaskConfig{Command: "/bin/true"}, "nobody" + hostileText},
		{"user_group", TaskConfig{Command: "/bin/true"}, "nobody:nogroup" + hostileText},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			task := realTask(t, "hostile", tc.tc)
			task.User = tc.user
			// No allocation directory: each start fails before the
			// task's output is opened.
			_, _, err := h.StartTask(task)
			must.Error(t, err)
			t.Logf("start error: %v", err)
			mustCleanAndCarry(t, err.Error())
		})
	}
	for _, e := range events() {
		must.True(t, safetext.IsClean(e.Message), must.Sprintf("event %q", e.Message))
		for k, v := range e.Annotations {
			must.True(t, safetext.IsClean(k) && safetext.IsClean(v), must.Sprintf("annotation %q=%q", k, v))
		}
	}
}

// collectEvents reads the driver's task events until the test ends; the
// function returns those read so far.
func collectEvents(t *testing.T, d interface {
	TaskEvents(context.Context) (<-chan *drivers.TaskEvent, error)
}) func() []*drivers.TaskEvent {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := d.TaskEvents(ctx)
	must.NoError(t, err)
	var (
		mu  sync.Mutex
		got []*drivers.TaskEvent
	)
	go func() {
		for e := range ch {
			mu.Lock()
			got = append(got, e)
			mu.Unlock()
		}
	}()
	return func() []*drivers.TaskEvent {
		time.Sleep(100 * time.Millisecond) // events in flight
		mu.Lock()
		defer mu.Unlock()
		return append([]*drivers.TaskEvent(nil), got...)
	}
}

// hostileText is what the tests feed through a job's or a plugin's field:
// an OSC window title (ended by BEL, then by ST), a CSI clear screen and
// red colour, the 8-bit CSI (C1), a bidi override, a zero-width space and
// a newline (Nomad's strings are UTF-8: gRPC refuses any other). Its
// escaped OSC, hostileMark, shows that the text reached the message.
const (
	hostileText = "\x1b]0;PWNED\x07\x1b]2;T\x1b\\\x1b[2J\x1b[31mRED\u009b2J\u202egnp.exe\u200b\n"
	hostileMark = `\x1b]0;PWNED`
)

// mustCleanAndCarry checks that msg holds the hostile text, escaped, and
// nothing a terminal acts on.
func mustCleanAndCarry(t *testing.T, msg string) {
	t.Helper()
	must.True(t, safetext.IsClean(msg), must.Sprintf("raw terminal text in %q", msg))
	must.StrContains(t, msg, hostileMark, must.Sprint("the hostile text did not reach the message: the case proves nothing"))
	must.False(t, strings.ContainsAny(msg, "\x1b\x07\u009b\u202e\u200b\n"))
}
