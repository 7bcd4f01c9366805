package csihook

import (
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// BenchmarkManagerRecordsMemory measures the heap a manager keeps for its
// records: it writes a journal of 1000 volumes with one task each, then
// reports what New, which loads it, leaves on the heap per volume+task
// pair (the log's file and buffers included, which do not grow with the
// records). The records are held once, as the journal's state: when the
// manager kept maps of its own beside the journal's, this gave about
// 2880 B per pair against 2083 B now.
func BenchmarkManagerRecordsMemory(b *testing.B) {
	const n = 1000
	root := b.TempDir()
	dir := filepath.Join(root, "journal")
	j, err := openJournal(dir, hclog.NewNullLogger())
	if err != nil {
		b.Fatal(err)
	}
	for i := range n {
		vid := fmt.Sprintf("vol-%04d", i)
		v := volRecord{PluginID: "hostpath", VolumeID: vid, StagingPath: "/var/lib/nomad/csi/staging/hostpath/" + vid,
			NodeID: "node-1", AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem, FSType: "ext4",
			MountFlags: []string{"noatime"}, VolumeContext: map[string]string{"ctx": "v"}, Stage: phaseStaged, Server: "hostpath-1"}
		t := taskRecord{TaskID: fmt.Sprintf("0f6c5a3e-6b1d-4b8a-9d2e-%012d", i), Name: "data", PluginID: "hostpath", VolumeID: vid,
			Target: "/var/lib/nomad/csi/publish/0123456789abcdef/data", Destination: "/data", AccessMode: AccessSingleNodeWriter,
			AttachmentMode: AttachmentFileSystem, FSType: "ext4", MountFlags: []string{"noatime"},
			VolumeContext: map[string]string{"ctx": "v"}, State: phasePublished}
		if err := j.commitLazy(volPut(v), taskPut(t)); err != nil {
			b.Fatal(err)
		}
	}
	j.close()
	cfg := Config{Root: root, Mounter: mounter.NewFake(), Logger: hclog.NewNullLogger(),
		Lookup: func(string) (PluginInfo, error) { return PluginInfo{}, errors.New("no plugins here") }}
	var perPair []float64
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		m, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		if m.Users("hostpath", "vol-0999") != 1 || len(m.Tasks()) != n {
			b.Fatalf("manager loaded %d tasks, want %d", len(m.Tasks()), n)
		}
		perPair = append(perPair, (float64(after.HeapAlloc)-float64(before.HeapAlloc))/n)
		m.Close()
	}
	// The median: a closed manager's timers may keep it on the heap while
	// the next one loads.
	slices.Sort(perPair)
	b.ReportMetric(perPair[len(perPair)/2], "B/vol+task")
}
