package driver

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

func setJournalRetry(t *testing.T, base, max time.Duration) {
	t.Helper()
	oldBase, oldMax := journalRetryBase, journalRetryMax
	journalRetryBase, journalRetryMax = base, max
	t.Cleanup(func() { journalRetryBase, journalRetryMax = oldBase, oldMax })
}

// While the journal cannot be opened (here: another driver process holds
// it), the driver keeps trying to open it and recover, and a teardown
// asked for meanwhile is done once it opens, even of a task recovery keeps
// as live.
func TestVolumes_recoveryAndTeardownWaitForTheJournal(t *testing.T) {
	setJournalRetry(t, time.Millisecond, 20*time.Millisecond)
	sockets := shortTempDir(t)
	cfg := Config{Enabled: true, RootDir: shortTempDir(t), PluginSocketDirs: []string{sockets}}
	sock := filepath.Join(sockets, "hp", "csi.sock")
	listenUnix(t, sock)

	d := newTestDriver(t, cfg)
	fp := withFakePlugins(t, d)
	d.prober.Rescan()
	waitHealthy(t, d, "hp")
	w := jobTask(t, TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": {
		PluginID: "hp", VolumeID: "v1", Destination: "/data", AccessMode: "single-node-writer", AttachmentMode: "file-system",
	}}}, "alloc-w", "default", "web")
	handle, _, err := d.StartTask(w)
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))

	// A second driver process on the same root_dir: the first holds the
	// journal.
	d2 := newTestDriver(t, cfg)
	fp2 := withFakePlugins(t, d2)
	d2.prober.Rescan()
	waitHealthy(t, d2, "hp")
	must.NoError(t, d2.RecoverTask(persisted(t, handle)))
	_, err = d2.volumes()
	must.ErrorContains(t, err, "is in use by another volume manager")
	err = d2.teardownVolumes(w.ID)
	must.ErrorContains(t, err, "is in use by another volume manager")
	must.ErrorContains(t, err, "the teardown is done once the journal opens")
	must.Eq(t, 0, fp2.vols.Count(csihook.MethodNodeUnpublishVolume))

	// The first process goes, and its lock with it: the second opens the
	// journal on a retry, recovers (the task is live: it keeps its
	// volume) and does the teardown it was asked for.
	d.Shutdown()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return fp2.vols.Count(csihook.MethodNodeUnpublishVolume) == 1
	}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)), must.Sprint("the deferred teardown never ran"))
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		st, err := csihook.ReadJournal(filepath.Join(cfg.RootDir, "journal"))
		return err == nil && st.Empty()
	}), wait.Timeout(10*time.Second), wait.Gap(5*time.Millisecond)), must.Sprint("the journal keeps the volume"))
	must.Eq(t, 1, fp2.vols.Count(csihook.MethodNodeUnpublishVolume))
}

// Shutdown stops the retries of a journal that never opens.
func TestVolumes_journalRetryStopsOnShutdown(t *testing.T) {
	setJournalRetry(t, time.Millisecond, 5*time.Millisecond)
	cfg := Config{Enabled: true, RootDir: shortTempDir(t)}
	d := newTestDriver(t, cfg)
	_, err := d.volumes()
	must.NoError(t, err)
	d2 := newTestDriver(t, cfg)
	done := make(chan struct{})
	go func() {
		d2.Shutdown()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Shutdown waits for the journal retries")
	}
}
