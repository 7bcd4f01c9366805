package driver

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/plugins/shared/hclspec"
	"github.com/shoenig/test/must"
)

// docRow is one row of a key table in docs/: the key's cell as written
// (`volume "<name>"` keeps its label), its default and meaning cells.
type docRow struct{ key, def, meaning string }

var docKeyCell = regexp.MustCompile("^`([a-z_]+)[^`]*`$")

// docTable reads the first table under heading (a line of the page) whose
// header starts with "| key |": its rows by key.
func docTable(t *testing.T, page, heading string) map[string]docRow {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docs", page))
	must.NoError(t, err)
	lines := strings.Split(string(b), "\n")
	start := -1
	for i, l := range lines {
		if l == heading {
			start = i
			break
		}
	}
	must.NonNegative(t, start, must.Sprintf("no heading %q in docs/%s", heading, page))
	rows := map[string]docRow{}
	in := false
	for _, l := range lines[start+1:] {
		if strings.HasPrefix(l, "#") {
			break
		}
		switch {
		case strings.HasPrefix(l, "| key |"):
			in = true
			continue
		case in && strings.HasPrefix(l, "| ---"):
			continue
		case in && !strings.HasPrefix(l, "|"):
			in = false
		}
		if !in {
			if len(rows) > 0 {
				break
			}
			continue
		}
		cells := strings.Split(strings.Trim(l, "|"), " | ")
		must.GreaterEq(t, 4, len(cells), must.Sprintf("docs/%s: row %q has fewer than 4 cells", page, l))
		m := docKeyCell.FindStringSubmatch(strings.TrimSpace(cells[0]))
		must.SliceLen(t, 2, m, must.Sprintf("docs/%s: row %q does not start with a `key`", page, l))
		rows[m[1]] = docRow{key: m[1], def: strings.TrimSpace(cells[2]), meaning: strings.Join(cells[3:], " | ")}
	}
	must.MapNotEmpty(t, rows, must.Sprintf("docs/%s: no key table under %q", page, heading))
	return rows
}

// specKeys are the attributes and blocks of an object spec, or of the
// object inside a block, block list or block map spec.
func specKeys(t *testing.T, s *hclspec.Spec) map[string]*hclspec.Spec {
	t.Helper()
	switch {
	case s.GetObject() != nil:
		return s.GetObject().GetAttributes()
	case s.GetBlockValue() != nil:
		return specKeys(t, s.GetBlockValue().GetNested())
	case s.GetBlockList() != nil:
		return specKeys(t, s.GetBlockList().GetNested())
	case s.GetBlockMap() != nil:
		return specKeys(t, s.GetBlockMap().GetNested())
	}
	t.Fatalf("spec %v holds no object", s)
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// checkDocTable: every key of the spec has a row in the table and every
// row a key of the spec; a key with a default shows it in its default
// cell; a required attribute says "required"; the fields of a nested
// block (a grant's, auth's, create's) are each named in the meaning cell.
// hidden are keys of the spec that the table need not show, elsewhere
// blocks whose fields another table shows, each with where.
func checkDocTable(t *testing.T, where string, spec *hclspec.Spec, rows map[string]docRow, hidden, elsewhere map[string]string) {
	t.Helper()
	keys := specKeys(t, spec)
	for _, k := range sortedKeys(keys) {
		s := keys[k]
		row, ok := rows[k]
		if !ok {
			if _, ok := hidden[k]; !ok {
				t.Errorf("%s: key %q of the spec has no row", where, k)
			}
			continue
		}
		if d := s.GetDefault(); d != nil {
			lit := d.GetDefault().GetLiteral().GetValue()
			if !defaultShown(lit, row.def) {
				t.Errorf("%s: key %q defaults to %s, but its default cell says %q", where, k, lit, row.def)
			}
		}
		if a := s.GetAttr(); a != nil && a.GetRequired() && !strings.HasPrefix(row.def, "required") {
			t.Errorf("%s: key %q is required, but its default cell says %q", where, k, row.def)
		}
		var nested map[string]*hclspec.Spec
		switch {
		case elsewhere[k] != "":
		case s.GetBlockValue() != nil, s.GetBlockList() != nil:
			nested = specKeys(t, s)
		}
		for _, f := range sortedKeys(nested) {
			if !strings.Contains(row.meaning, "`"+f+"`") && !regexp.MustCompile(`\b`+f+` = `).MatchString(row.meaning) {
				t.Errorf("%s: key %q's field %q is not named in its row", where, k, f)
			}
		}
	}
	for _, k := range sortedKeys(rows) {
		if _, ok := keys[k]; !ok {
			t.Errorf("%s: row %q names no key of the spec", where, k)
		}
	}
}

// defaultShown reports whether a default cell shows the spec's default
// literal: a string as `"v"` or `v`, a list by each of its elements
// (case aside), anything else as written.
func defaultShown(lit, cell string) bool {
	if strings.HasPrefix(lit, "[") {
		var elems []string
		for _, e := range strings.Split(strings.Trim(lit, "[]"), ",") {
			if e = strings.TrimSpace(e); e != "" {
				elems = append(elems, e)
			}
		}
		lower := strings.ToLower(cell)
		for _, e := range elems {
			v, err := strconv.Unquote(e)
			if err != nil || !strings.Contains(lower, "`"+strings.ToLower(v)+"`") {
				return false
			}
		}
		return len(elems) > 0
	}
	if v, err := strconv.Unquote(lit); err == nil {
		return strings.Contains(cell, "`"+v+"`") || strings.Contains(cell, "`"+lit+"`")
	}
	return strings.Contains(cell, "`"+lit+"`")
}

// The docs' key tables and the specs the agent and Nomad decode with say
// the same: the same keys, the same defaults.
func TestDocs_keyTablesMatchSpecs(t *testing.T) {
	t.Run("plugin configuration", func(t *testing.T) {
		checkDocTable(t, "docs/plugin-configuration.md", configSpec,
			docTable(t, "plugin-configuration.md", "# Plugin configuration"),
			map[string]string{"metrics_token": "refused; metrics_token_file's row says why"}, nil)
	})
	t.Run("task configuration", func(t *testing.T) {
		checkDocTable(t, "docs/task-configuration.md", taskConfigSpec,
			docTable(t, "task-configuration.md", "# Task configuration"), nil,
			map[string]string{"csi_plugin": "docs/plugins.md", "volume": "docs/volumes.md"})
	})
	t.Run("volume block", func(t *testing.T) {
		checkDocTable(t, "docs/volumes.md", volumeSpec,
			docTable(t, "volumes.md", "## The `volume` block"), nil, nil)
	})
	t.Run("csi_plugin block", func(t *testing.T) {
		checkDocTable(t, "docs/plugins.md", taskConfigSpec.GetObject().GetAttributes()["csi_plugin"],
			docTable(t, "plugins.md", "## The `csi_plugin` block"), nil, nil)
	})
}
