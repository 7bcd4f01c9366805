package csihook

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// journalFilesHolding lists the files under the journal directory whose
// raw bytes hold secret: the log, a compaction's temp file, a damaged
// copy, a record file of the old format, anything.
func journalFilesHolding(t testing.TB, root, secret string) []string {
	t.Helper()
	var out []string
	dir := filepath.Join(root, "journal")
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) && path != dir {
				// A temp file that came and went.
				return nil
			}
			return err
		}
		if d.IsDir() {
			return nil
		}
		data, err := os.ReadFile(path)
		if os.IsNotExist(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if bytes.Contains(data, []byte(secret)) {
			out = append(out, path)
		}
		return nil
	})
	must.NoError(t, err)
	return out
}

// waitJournalWithout waits until no journal file holds secret: the
// compaction that removes what no record needs any more follows a commit
// within compactDelay.
func waitJournalWithout(t testing.TB, root, secret string) {
	t.Helper()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool { return len(journalFilesHolding(t, root, secret)) == 0 }),
		wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)),
		must.Sprintf("the secret stays in the journal: %v", journalFilesHolding(t, root, secret)))
}

// diskVolSecrets are the secrets the volume record of vol1 holds in the
// log as it is on disk.
func diskVolSecrets(t testing.TB, root string) map[string]string {
	t.Helper()
	return diskJournal(t, filepath.Join(root, "journal")).vols[volKey{"p", "vol1"}].Secrets
}

// stagingPlugin stages and publishes, without ControllerPublishVolume:
// its volume records need no secrets once staged, so whatever the journal
// holds of them is what a stage left.
func stagingPlugin(h *harness) {
	p := fullPlugin("p")
	p.ControllerPublish = false
	h.setPlugin(p)
}

func multi(r VolumeRequest) VolumeRequest { r.AccessMode = AccessMultiNodeMultiWriter; return r }

// A stage made again beside a task that has the volume, that the plugin
// refuses with a final code, fails the starting task alone: the task that
// has the volume keeps its mount and record, the volume's record says
// the stage was refused, and the journal drops its secrets at once (left
// staging, it kept them until the last teardown, and a driver restart
// staged again what was refused, with them). A restart then stages
// nothing; the last task's teardown still unstages. Both ways to a stage
// made again: a plugin that forgot its stage answers NodePublishVolume
// "not staged" (TestSpec_PublishNotStagedStagesAgain), and a staging
// mount gone after a driver restart is staged again at the next start.
func TestSpec_RestageRefusedDropsSecretsAndLeavesOthers(t *testing.T) {
	cases := []struct {
		name string
		// lose makes the volume need a stage again before task b starts.
		lose      func(h *harness, p *stageForgetting)
		wantCalls []string
	}{
		{
			name: "plugin forgot its stage",
			lose: func(h *harness, p *stageForgetting) { p.forget() },
			// The refused publish is the wrapper's, not among the fake's
			// calls; b's publish is undone.
			wantCalls: []string{MethodNodeStageVolume, MethodNodeUnpublishVolume},
		},
		{
			name: "staging mount gone after a driver restart",
			lose: func(h *harness, p *stageForgetting) {
				h.restart()
				must.NoError(t, h.mnt.Unmount(h.m.StagingPath("p", "vol1")))
			},
			wantCalls: []string{MethodNodeStageVolume},
		},
	}
	for _, tc := range cases {
		// A volume without secrets is not staged again by a restart
		// either: the refusal, not the want of secrets, says so.
		for _, secrets := range []bool{true, false} {
			name := tc.name
			if !secrets {
				name += "/without secrets"
			}
			t.Run(name, func(t *testing.T) {
				testRestageRefused(t, secrets, tc.lose, tc.wantCalls)
			})
		}
	}
}

func testRestageRefused(t *testing.T, secrets bool, lose func(h *harness, p *stageForgetting), wantCalls []string) {
	setCompactDelay(t, time.Millisecond)
	var p *stageForgetting
	h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return p, nil } })
	p = &stageForgetting{FakeClient: h.fake, staged: map[string]bool{}}
	stagingPlugin(h)
	ctx := context.Background()
	r := multi(req("data", "vol1", "/data"))
	if !secrets {
		r.Secrets = nil
	}

	_, err := h.m.Setup(ctx, "a", []VolumeRequest{r})
	must.NoError(t, err)
	waitJournalWithout(t, h.root, canary)
	lose(h, p)
	h.fake.ResetCalls()
	h.fake.SetNextError(MethodNodeStageVolume, status.Error(codes.InvalidArgument, "refused"))
	_, err = h.m.Setup(ctx, "b", []VolumeRequest{r})
	must.ErrorContains(t, err, "InvalidArgument: refused")
	must.Eq(t, wantCalls, h.fake.Methods())
	must.Eq(t, r.Secrets, h.fake.Calls()[0].Secrets)
	must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/"}, h.journalRecords())
	must.MapEmpty(t, diskVolSecrets(t, h.root))
	waitJournalWithout(t, h.root, canary)
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))
	must.Eq(t, 1, h.m.Users("p", "vol1"))

	h.restart()
	h.fake.ResetCalls()
	must.NoError(t, h.m.Recover(func(string) bool { return true }))
	h.waitIdle()
	must.SliceEmpty(t, h.fake.Methods())
	must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/"}, h.journalRecords())
	must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))

	h.fake.ResetCalls()
	must.NoError(t, h.m.Teardown(ctx, "a"))
	must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
	must.SliceEmpty(t, h.mountPaths())
}

// A stage made again whose outcome the driver cannot know (retries of a
// retryable code ran out, the attempts ran out of time) may have staged
// the volume: the record stays staging with its secrets, and a driver
// restart stages it again with them. Should the plugin refuse that
// stage, the record says so and the secrets leave the journal, and the
// next restart stages nothing.
func TestSpec_RestageUncertainKeepsSecretsForRecovery(t *testing.T) {
	for _, code := range []codes.Code{codes.Unavailable, codes.DeadlineExceeded, codes.Aborted} {
		for _, refuse := range []bool{false, true} {
			name := code.String() + "/recovery stages"
			if refuse {
				name = code.String() + "/recovery's stage refused"
			}
			t.Run(name, func(t *testing.T) {
				setCompactDelay(t, time.Millisecond)
				var p *stageForgetting
				h := newHarness(t, func(c *Config) { c.Dial = func(string) (Client, error) { return p, nil } })
				p = &stageForgetting{FakeClient: h.fake, staged: map[string]bool{}}
				stagingPlugin(h)
				ctx := context.Background()

				_, err := h.m.Setup(ctx, "a", []VolumeRequest{multi(req("data", "vol1", "/data"))})
				must.NoError(t, err)
				p.forget()
				h.fake.ResetCalls()
				h.fake.SetError(MethodNodeStageVolume, status.Error(code, "no answer"))
				_, err = h.m.Setup(ctx, "b", []VolumeRequest{multi(req("data", "vol1", "/data"))})
				must.ErrorContains(t, err, code.String())
				h.fake.SetError(MethodNodeStageVolume, nil)
				// Retried up to RetryAttempts, then given up.
				must.Eq(t, 3, h.fake.Count(MethodNodeStageVolume))
				must.Eq(t, []string{"task a/data published", "vol p/vol1 staging/"}, h.journalRecords())
				must.Eq(t, canary, diskVolSecrets(t, h.root)["token"])
				must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))

				h.restart()
				h.fake.ResetCalls()
				if refuse {
					h.fake.SetError(MethodNodeStageVolume, status.Error(codes.PermissionDenied, "bad token"))
				}
				must.NoError(t, h.m.Recover(func(string) bool { return true }))
				h.waitIdle()
				h.fake.SetError(MethodNodeStageVolume, nil)
				// One stage, with the secrets the journal kept; a refused
				// one is not made again by the worker's retries.
				must.Eq(t, []string{MethodNodeStageVolume}, h.fake.Methods())
				must.Eq(t, canary, h.fake.Calls()[0].Secrets["token"])
				must.True(t, h.m.publishedAt(h.m.TargetPath("a", "data")))
				if !refuse {
					must.Eq(t, []string{"task a/data published", "vol p/vol1 staged/"}, h.journalRecords())
				} else {
					must.Eq(t, []string{"task a/data published", "vol p/vol1 refused/"}, h.journalRecords())
					h.restart()
					h.fake.ResetCalls()
					must.NoError(t, h.m.Recover(func(string) bool { return true }))
					h.waitIdle()
					must.SliceEmpty(t, h.fake.Methods())
				}
				waitJournalWithout(t, h.root, canary)

				h.fake.ResetCalls()
				must.NoError(t, h.m.Teardown(ctx, "a"))
				must.Eq(t, []string{MethodNodeUnpublishVolume, MethodNodeUnstageVolume}, h.fake.Methods())
				must.SliceEmpty(t, h.journalRecords())
				must.SliceEmpty(t, h.mountPaths())
			})
		}
	}
}
