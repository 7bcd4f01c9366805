package csihook

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Before the log, the journal kept one JSON file per record, each replaced
// atomically:
//
//	v-<hash(plugin id, volume id)>.json   a volRecord
//	t-<hash(task id)>-<hash(name)>.json   a taskRecord
//	c-<hash(plugin id, name)>.json        a createdRecord
//
// migrate reads such files into j.state, over what the log holds: a log
// beside them is either one they were already moved into, by a start that
// stopped before removing them, or older than they are. It returns the
// files read, for the caller to remove once the log holds them durably.
// Files that cannot be used are renamed *.bad and reported, never guessed
// at.
// recordFileKind tells whether name is a record file of the file-per-record
// format, and of which kind (v, t or c).
func recordFileKind(name string) (string, bool) {
	kind, _, _ := strings.Cut(name, "-")
	return kind, strings.HasSuffix(name, ".json") && (kind == "v" || kind == "t" || kind == "c")
}

// IsRecordFile tells whether a file of a journal directory is a record of
// the file-per-record format: one the driver still honours and moves into
// the log when it next opens the journal.
func IsRecordFile(name string) bool {
	_, ok := recordFileKind(name)
	return ok
}

func (j *journal) migrate(entries []fs.DirEntry) ([]string, error) {
	var done []string
	for _, e := range entries {
		name := e.Name()
		kind, ok := recordFileKind(name)
		if !ok {
			continue
		}
		path := filepath.Join(j.dir, name)
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("failed to read journal record %q: %w", path, err)
		}
		op, bad := decodeRecordFile(kind, data)
		if bad == nil {
			bad = op.check()
		}
		if bad == nil && name != op.fileName() {
			bad = errors.New("file name does not match the record's ids")
		}
		if bad != nil {
			j.logger.Error("unreadable journal record set aside; what it describes must be cleaned up by hand",
				"path", path, "error", bad)
			if err := os.Rename(path, path+".bad"); err != nil {
				return nil, fmt.Errorf("failed to set aside journal record %q: %w", path, err)
			}
			continue
		}
		j.state.applyLogged(op)
		done = append(done, path)
	}
	return done, nil
}

// decodeRecordFile decodes one file of the file-per-record format as a
// put.
func decodeRecordFile(kind string, data []byte) (journalOp, error) {
	var (
		op  journalOp
		err error
	)
	switch kind {
	case "v":
		op = journalOp{Op: opPutVol, Vol: &volRecord{}}
		err = json.Unmarshal(data, op.Vol)
	case "t":
		op = journalOp{Op: opPutTask, Task: &taskRecord{}}
		err = json.Unmarshal(data, op.Task)
	case "c":
		op = journalOp{Op: opPutCreated, Created: &createdRecord{}}
		err = json.Unmarshal(data, op.Created)
	}
	if err != nil {
		// Not the decoder's message: it can quote a value of the file,
		// and the file holds secrets.
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return op, fmt.Errorf("not valid JSON (at byte %d)", se.Offset)
		}
		return op, errors.New("not a journal record")
	}
	return op, nil
}

// fileName is the name a put's record had in the file-per-record format.
func (o journalOp) fileName() string {
	switch o.Op {
	case opPutVol:
		return "v-" + ShortHash(o.Vol.PluginID, o.Vol.VolumeID) + ".json"
	case opPutTask:
		return "t-" + ShortHash(o.Task.TaskID) + "-" + ShortHash(o.Task.Name) + ".json"
	case opPutCreated:
		return "c-" + ShortHash(o.Created.PluginID, o.Created.Name) + ".json"
	}
	return ""
}
