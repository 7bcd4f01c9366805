package csihook

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// BenchmarkSetupTeardown times Setup and Teardown of one fresh volume with
// the in-memory fake plugin, so what is left is the manager's own cost:
// mostly the journal's synced writes. The journal directory is on the
// file system of the test's temporary directory. Sub-benchmarks: a plugin
// that attaches and stages (full) and one that only stages (stage).
func BenchmarkSetupTeardown(b *testing.B) {
	for _, bc := range []struct {
		name string
		info PluginInfo
	}{
		{"full", fullPlugin("p")},
		{"stage", PluginInfo{ID: "p", Socket: "/run/p.sock", NodeID: "node-1", Healthy: true, StageUnstage: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			h := newHarness(b, func(c *Config) { c.Logger = hclog.NewNullLogger() })
			h.setPlugin(bc.info)
			ctx := context.Background()
			reqs := []VolumeRequest{req("data", "vol1", "/data")}
			var setup, teardown time.Duration
			n := 0
			for b.Loop() {
				t0 := time.Now()
				if _, err := h.m.Setup(ctx, "task-a", reqs); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := h.m.Teardown(ctx, "task-a"); err != nil {
					b.Fatal(err)
				}
				setup, teardown, n = setup+t1.Sub(t0), teardown+time.Since(t1), n+1
			}
			b.ReportMetric(float64(setup.Microseconds())/float64(n), "setup-µs/op")
			b.ReportMetric(float64(teardown.Microseconds())/float64(n), "teardown-µs/op")
		})
	}
}

// BenchmarkJournalCommit times one durable journal write of a task record
// (about 600 bytes), against two references measured in the same run:
// the file-per-record journal's atomic replace (temp file, fsync, rename,
// fsync of the directory) and a bare append and fdatasync of as many
// bytes. The journal directory is on the file system of the test's
// temporary directory.
func BenchmarkJournalCommit(b *testing.B) {
	rec := taskRecord{TaskID: "0f6c5a3e-6b1d-4b8a-9d2e-7c1f0a9b8e11", Name: "data", PluginID: "hostpath", VolumeID: "vol-0123456789",
		Target: "/var/lib/nomad/csi/publish/0123456789abcdef/data", Destination: "/data", AccessMode: AccessSingleNodeWriter,
		AttachmentMode: AttachmentFileSystem, FSType: "ext4", MountFlags: []string{"noatime"},
		VolumeContext: map[string]string{"ctx": "v"}, Secrets: map[string]string{"token": canary}, State: phasePublished}
	data, err := json.Marshal(taskPut(rec).Task)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("log", func(b *testing.B) {
		j, err := openJournal(b.TempDir(), hclog.NewNullLogger())
		if err != nil {
			b.Fatal(err)
		}
		defer j.close()
		for b.Loop() {
			if err := j.commit(taskPut(rec)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("file-per-record", func(b *testing.B) {
		dir := b.TempDir()
		path := filepath.Join(dir, taskPut(rec).fileName())
		for b.Loop() {
			f, err := os.CreateTemp(dir, ".tmp-")
			if err != nil {
				b.Fatal(err)
			}
			if _, err := f.Write(data); err != nil {
				b.Fatal(err)
			}
			if err := f.Sync(); err != nil {
				b.Fatal(err)
			}
			f.Close()
			if err := os.Rename(f.Name(), path); err != nil {
				b.Fatal(err)
			}
			if err := wal.SyncDir(dir); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("append-fdatasync-floor", func(b *testing.B) {
		f, err := os.OpenFile(filepath.Join(b.TempDir(), "floor"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		for b.Loop() {
			if _, err := f.Write(data); err != nil {
				b.Fatal(err)
			}
			if err := wal.Fdatasync(f); err != nil {
				b.Fatal(err)
			}
		}
	})
}
