package main

// Condition rules: a test-only knob that makes NodeGetVolumeStats report a
// volume's condition as abnormal while the test wants it (e2e/stats_test.go).
//
// The rules are read from a control file (<state-dir>/conditions) on every
// NodeGetVolumeStats; a missing file means every volume is as its data
// says. Each line that is neither empty nor a "#" comment is one rule:
//
//	VOLUME MESSAGE
//
// VOLUME is "*" or a string the volume's id or name contains; MESSAGE is
// the rest of the line, or, when it starts with a double quote, a Go
// string literal (so a test can send control characters, as a hostile
// plugin could). The first rule that matches makes the volume abnormal
// with MESSAGE. Removing the line makes it normal again.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// conditionsFile is the control file of condition rules.
func (p *plugin) conditionsFile() string { return filepath.Join(p.cfg.stateDir, "conditions") }

// abnormalCondition returns the message of the first rule matching the
// volume, if any.
func (p *plugin) abnormalCondition(v *volume) (string, bool, error) {
	b, err := os.ReadFile(p.conditionsFile())
	if errors.Is(err, fs.ErrNotExist) {
		return "", false, nil
	}
	if err != nil {
		return "", false, err
	}
	return matchCondition(string(b), v.ID, v.Name)
}

func matchCondition(data, id, name string) (string, bool, error) {
	for i, line := range strings.Split(data, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		vol, msg, _ := strings.Cut(line, " ")
		msg = strings.TrimSpace(msg)
		if strings.HasPrefix(msg, `"`) {
			u, err := strconv.Unquote(msg)
			if err != nil {
				return "", false, fmt.Errorf("condition rule %d %q: the message is not a Go string literal: %v", i+1, line, err)
			}
			msg = u
		}
		if vol == "*" || (id != "" && strings.Contains(id, vol)) || (name != "" && strings.Contains(name, vol)) {
			return msg, true, nil
		}
	}
	return "", false, nil
}
