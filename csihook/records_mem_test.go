package csihook

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/hashicorp/go-hclog"
)

// BenchmarkRecordCopyMemory measures what the manager's second copy of
// the volume and task records costs (see issue 13 item 2: the journal's
// state and the manager's maps both hold them). It loads a journal of
// 1000 volumes with one task each, then builds the manager's maps from
// it as New does, and reports the heap the maps keep per volume+task
// pair: what keeping the records once would save. The strings and maps
// inside the records are shared by both copies; what is counted is the
// record structs and the map buckets.
func BenchmarkRecordCopyMemory(b *testing.B) {
	const n = 1000
	dir := b.TempDir()
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
	j, err = openJournal(dir, hclog.NewNullLogger())
	if err != nil {
		b.Fatal(err)
	}
	defer j.close()
	var perPair float64
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		vols, tasks := j.records()
		mv := map[volKey]volRecord{}
		mt := map[string]map[string]taskRecord{}
		for _, v := range vols {
			mv[v.key()] = v
		}
		for _, t := range tasks {
			if mt[t.TaskID] == nil {
				mt[t.TaskID] = map[string]taskRecord{}
			}
			mt[t.TaskID][t.Name] = t
		}
		vols, tasks = nil, nil
		runtime.GC()
		runtime.ReadMemStats(&after)
		if len(mv) != n || len(mt) != n {
			b.Fatalf("copied %d volumes and %d tasks, want %d each", len(mv), len(mt), n)
		}
		perPair = float64(after.HeapAlloc-before.HeapAlloc) / n
		runtime.KeepAlive(mv)
		runtime.KeepAlive(mt)
	}
	b.ReportMetric(perPair, "B/vol+task")
}
