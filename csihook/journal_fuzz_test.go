package csihook

import (
	"encoding/json"
	"regexp"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook/wal"
)

// The journal's fuzz targets call scanLog, readFrame, encodeFrame,
// journalOp.check, journalState.snapshot and decodeRecordFile, and read
// logScan's end, torn, damaged, badOps and state.

// fuzzOps is a batch of every kind of op, as the manager writes them.
func fuzzOps() []journalOp {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	vol := volRecord{Version: journalVersion, PluginID: "p", VolumeID: "v1", StagingPath: "/staging/v1", NodeID: "node-1",
		AccessMode: AccessSingleNodeWriter, AttachmentMode: AttachmentFileSystem, MountFlags: []string{"noatime"},
		Secrets: map[string]string{"token": canary}, Stage: phaseStaged, Controller: phasePublished, Updated: at}
	task := taskRecord{Version: journalVersion, TaskID: "alloc/web/1", Name: "data", Seq: 1, PluginID: "p", VolumeID: "v1",
		Target: "/publish/x/data", Destination: "/data", AccessMode: AccessSingleNodeWriter,
		AttachmentMode: AttachmentFileSystem, State: phasePublished, Updated: at}
	created := createdRecord{Version: journalVersion, PluginID: "p", Name: "scratch", VolumeID: "v2", Updated: at}
	owner := ownerRecord{Version: journalVersion, PluginID: "p", VolumeID: "v1", Namespace: "default", Updated: at}
	// A stage the plugin refused, as the log holds it: without secrets.
	refused := vol
	refused.VolumeID, refused.StagingPath, refused.Stage, refused.Controller, refused.Secrets = "v3", "/staging/v3", phaseStageRefused, phaseNone, nil
	return []journalOp{
		{Op: opPutVol, Vol: &vol}, {Op: opPutTask, Task: &task}, {Op: opPutCreated, Created: &created},
		{Op: opPutOwner, Owner: &owner}, taskDrop("alloc/web/0", "old"), volDrop(volKey{"p", "v0"}),
		createdDrop("p", "gone"), {Op: opPutVol, Vol: &refused},
	}
}

// refusedFrame is a log frame written by hand, not by the code: a volume
// record in stage "refused". Its bytes are the encoding the journal
// reads; a change of it fails FuzzScanLog's seeds.
func refusedFrame(tb testing.TB) []byte {
	tb.Helper()
	frame, err := wal.EncodeFrame([]byte(`{"ops":[{"op":"put_vol","vol":{"version":1,"plugin_id":"p","volume_id":"vr",` +
		`"staging_path":"/staging/vr","access_mode":"single-node-writer","attachment_mode":"file-system",` +
		`"had_secrets":true,"stage":"refused","updated":"2026-01-02T03:04:05Z"}}]}`))
	if err != nil {
		tb.Fatal(err)
	}
	return frame
}

func mustFrame(tb testing.TB, ops []journalOp) []byte {
	tb.Helper()
	frame, err := encodeFrame(ops)
	if err != nil {
		tb.Fatal(err)
	}
	return frame
}

// stateJSON is the live records of s in a stable form, for comparing two
// states (records decoded from JSON and encoded again compare equal).
func stateJSON(tb testing.TB, s *journalState) string {
	tb.Helper()
	b, err := json.Marshal(s.snapshot())
	if err != nil {
		tb.Fatal(err)
	}
	return string(b)
}

// FuzzScanLog replays arbitrary bytes as a journal log. It must not panic
// or loop; the offsets it reports must lie in the data; every record it
// yields must pass the check a record read back passes and sit under its
// own key; writing the result out again as one frame must read back as
// the same records with nothing torn, damaged or unusable; and an intact
// frame appended after whatever the data holds must be replayed, later
// than everything before it.
func FuzzScanLog(f *testing.F) {
	ops := fuzzOps()
	frame := mustFrame(f, ops)
	second := mustFrame(f, []journalOp{volDrop(volKey{"p", "v1"}), {Op: "put_nothing"}})
	f.Add([]byte{})
	f.Add(frame)
	f.Add(append(append([]byte{}, frame...), second...))
	f.Add(append(append([]byte{}, frame...), make([]byte, 64)...))
	f.Add(append(append([]byte{}, frame...), second[:len(second)/2]...))
	damaged := append(append([]byte{}, frame...), second...)
	damaged[wal.HeaderSize+3] ^= 0x20
	f.Add(damaged)
	f.Add([]byte(wal.Magic + "\x10\x00\x00\x00\x00\x00\x00\x00{\"ops\":[{}]}"))
	f.Add(mustFrame(f, []journalOp{{Op: opPutVol}, {Op: opPutTask, Task: &taskRecord{Version: journalVersion}}}))
	f.Add(mustFrame(f, nil))
	f.Add([]byte(wal.Magic + wal.Magic + wal.Magic))
	refused := refusedFrame(f)
	if v := scanLog(refused, hclog.NewNullLogger()).state.vols[volKey{"p", "vr"}]; v.Stage != phaseStageRefused || v.needsSecrets() {
		f.Fatalf("a record written with stage \"refused\" reads back as stage %q (the code's refused is %q), needing secrets %v", v.Stage, phaseStageRefused, v.needsSecrets())
	}
	f.Add(refused)
	f.Add(append(append([]byte{}, frame...), refused...))

	at := time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC)
	marker := volRecord{Version: journalVersion, PluginID: "fuzz", VolumeID: "marker", StagingPath: "/s", Updated: at}
	tail := mustFrame(f, []journalOp{{Op: opPutVol, Vol: &marker}, volDrop(volKey{"p", "v1"})})

	f.Fuzz(func(t *testing.T, data []byte) {
		s := scanLog(data, hclog.NewNullLogger())
		if s.end < 0 || s.end > len(data) || s.torn < 0 || s.end+s.torn > len(data) ||
			s.damaged < 0 || s.damaged > len(data) || s.badOps < 0 {
			t.Fatalf("scan of %d bytes: end %d, torn %d, damaged %d, bad ops %d", len(data), s.end, s.torn, s.damaged, s.badOps)
		}
		checkState(t, s.state)

		// Written out again, the records read back the same and whole.
		again := scanLog(mustFrame(t, s.state.snapshot()), hclog.NewNullLogger())
		if again.torn+again.damaged+again.badOps != 0 {
			t.Fatalf("re-encoded state scans with torn %d, damaged %d, bad ops %d", again.torn, again.damaged, again.badOps)
		}
		if got, want := stateJSON(t, again.state), stateJSON(t, s.state); got != want {
			t.Fatalf("re-encoded state differs:\n got %s\nwant %s", got, want)
		}

		// An intact frame after anything is replayed, and wins.
		withTail := scanLog(append(append([]byte{}, data...), tail...), hclog.NewNullLogger())
		if withTail.end != len(data)+len(tail) || withTail.torn != 0 {
			t.Fatalf("appended frame not read to the end: end %d of %d, torn %d", withTail.end, len(data)+len(tail), withTail.torn)
		}
		if got, ok := withTail.state.vols[marker.key()]; !ok || got.StagingPath != marker.StagingPath {
			t.Fatalf("appended frame's put not replayed: %+v %v", got, ok)
		}
		if _, ok := withTail.state.vols[volKey{"p", "v1"}]; ok {
			t.Fatal("appended frame's drop not replayed")
		}
		checkState(t, withTail.state)

		// readFrame at any offset stays in the data.
		for off := 0; off < len(data); off++ {
			payload, next, ok := wal.ReadFrame(data, off)
			if ok && (next <= off || next > len(data) || next-off != wal.HeaderSize+len(payload)) {
				t.Fatalf("wal.ReadFrame(%d) = %d bytes, next %d, in %d bytes", off, len(payload), next, len(data))
			}
		}
	})
}

// checkState fails when a record of s would not pass the check a record
// read back from the log must pass, or is not under its own key.
func checkState(t *testing.T, s *journalState) {
	t.Helper()
	for k, v := range s.vols {
		if err := (journalOp{Op: opPutVol, Vol: &v}).check(); err != nil || k != v.key() {
			t.Fatalf("volume record %+v under %v: %v", v, k, err)
		}
	}
	for id, recs := range s.tasks {
		if len(recs) == 0 {
			t.Fatalf("task %q has an empty map of records", id)
		}
		for name, tr := range recs {
			if err := (journalOp{Op: opPutTask, Task: &tr}).check(); err != nil || id != tr.TaskID || name != tr.Name {
				t.Fatalf("task record %+v under %s/%s: %v", tr, id, name, err)
			}
		}
	}
	for k, c := range s.created {
		if err := (journalOp{Op: opPutCreated, Created: &c}).check(); err != nil || k != (createdKey{c.PluginID, c.Name}) {
			t.Fatalf("created record %+v under %v: %v", c, k, err)
		}
	}
	for k, o := range s.owners {
		if err := (journalOp{Op: opPutOwner, Owner: &o}).check(); err != nil || k != (volKey{o.PluginID, o.VolumeID}) {
			t.Fatalf("owner record %+v under %v: %v", o, k, err)
		}
	}
}

// recordFileErr is every error decodeRecordFile may give: never the
// decoder's own message, which can quote the file's secrets.
var recordFileErr = regexp.MustCompile(`^(not valid JSON \(at byte [0-9]+\)|not a journal record)$`)

// FuzzDecodeRecordFile decodes arbitrary bytes as a record file of the
// file-per-record format. It must not panic; its errors are one of two
// fixed forms; a record it returns is a put of the file's kind.
func FuzzDecodeRecordFile(f *testing.F) {
	for _, o := range fuzzOps()[:3] {
		var rec any
		kind := "v"
		switch o.Op {
		case opPutVol:
			rec = o.Vol
		case opPutTask:
			rec, kind = o.Task, "t"
		case opPutCreated:
			rec, kind = o.Created, "c"
		}
		b, err := json.Marshal(rec)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(kind, b)
	}
	f.Add("v", []byte(`{"version": "1", "secrets": {"token": "`+canary+`"}}`))
	f.Add("t", []byte(`[`))
	f.Add("c", []byte(`null`))
	f.Add("x", []byte(`{}`))

	f.Fuzz(func(t *testing.T, kind string, data []byte) {
		op, err := decodeRecordFile(kind, data)
		if err != nil {
			if !recordFileErr.MatchString(err.Error()) {
				t.Fatalf("error %q is not one of the fixed forms", err)
			}
			return
		}
		want := map[string]string{"v": opPutVol, "t": opPutTask, "c": opPutCreated}[kind]
		if op.Op != want {
			t.Fatalf("kind %q decoded as op %q", kind, op.Op)
		}
	})
}
