package main

import (
	"os"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/shoenig/test/must"
)

func TestSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Install and upgrade":                          "install-and-upgrade",
		"The `csi_plugin` block":                       "the-csi_plugin-block",
		"The plugin block's name":                      "the-plugin-blocks-name",
		"Hunting a leak: the driver's goroutine count": "hunting-a-leak-the-drivers-goroutine-count",
		"Native CSI or driver-managed volumes":         "native-csi-or-driver-managed-volumes",
		"See [Volumes](volumes.md) now":                "see-volumes-now",
		"Why a supervisor, not an executor":            "why-a-supervisor-not-an-executor",
	} {
		must.EqOp(t, want, Slug(in), must.Sprintf("Slug(%q)", in))
	}
}

// repo is a small repository whose pages are all sound; each case of
// TestCheck breaks one thing in a copy.
func repo() fstest.MapFS {
	return fstest.MapFS{
		"README.md": {Data: []byte("# Project\n\nSee [install](docs/install.md#from-a-release), [top](#project) and " +
			"[the licence](LICENSE).\n\n```hcl\njob \"x\" {\n  type = \"batch\"\n```\n\n" +
			"`[not a link](nowhere.md)` and\n\n```sh\n[also not](nowhere.md)\n```\n")},
		"CHANGELOG.md":              {Data: []byte("# Changelog\n\n[Keep a Changelog](https://keepachangelog.com/)\n")},
		"LICENSE":                   {Data: []byte("MPL")},
		"docs/install.md":           {Data: []byte("# Install\n\n## From a release\n\n## Twice\n\n## Twice\n\nBack to [the README](../README.md).\n")},
		"examples/jobs/x.nomad.hcl": {Data: []byte("# comment\njob \"x\" {\n  type = \"batch\"\n}\n")},
	}
}

func TestCheck(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(fstest.MapFS)
		wants []string // each a substring of one problem, in order
	}{
		{name: "sound", edit: func(fstest.MapFS) {}},
		{
			name: "missing file",
			edit: func(r fstest.MapFS) {
				r["docs/install.md"].Data = append(r["docs/install.md"].Data, []byte("[x](volumes.md)\n")...)
			},
			wants: []string{`docs/install.md:10: link "volumes.md": docs/volumes.md does not exist`},
		},
		{
			name: "missing anchor",
			edit: func(r fstest.MapFS) {
				r["README.md"].Data = []byte(strings.Replace(string(r["README.md"].Data), "#from-a-release", "#from-source", 1))
			},
			wants: []string{`README.md:3: link "docs/install.md#from-source": docs/install.md has no heading with the anchor #from-source`},
		},
		{
			name: "duplicate headings get numbered anchors",
			edit: func(r fstest.MapFS) {
				r["README.md"].Data = append(r["README.md"].Data, []byte("[a](docs/install.md#twice-1) [b](docs/install.md#twice-2)\n")...)
			},
			wants: []string{`"docs/install.md#twice-2"`},
		},
		{
			name: "example not in examples/",
			edit: func(r fstest.MapFS) {
				r["README.md"].Data = []byte(strings.Replace(string(r["README.md"].Data), `type = "batch"`, `type = "service"`, 1))
			},
			wants: []string{"README.md:5: this hcl example is not an excerpt"},
		},
		{
			name: "link leaving the repository",
			edit: func(r fstest.MapFS) {
				r["docs/install.md"].Data = append(r["docs/install.md"].Data, []byte("[up](../../etc/passwd)\n")...)
			},
			wants: []string{"leaves the repository"},
		},
		{
			name: "fragment into a file that is not a page",
			edit: func(r fstest.MapFS) {
				r["docs/install.md"].Data = append(r["docs/install.md"].Data, []byte("[l](../LICENSE#x)\n")...)
			},
			wants: []string{"is not a markdown page"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := repo()
			tc.edit(r)
			problems, err := Check(r)
			must.NoError(t, err)
			must.Len(t, len(tc.wants), problems, must.Sprintf("%v", problems))
			for i, w := range tc.wants {
				must.StrContains(t, problems[i].String(), w)
			}
		})
	}
}

// TestRepository checks this repository's own documentation, so that
// make unit fails on a broken link too.
func TestRepository(t *testing.T) {
	problems, err := Check(os.DirFS("../.."))
	must.NoError(t, err)
	must.SliceEmpty(t, problems, must.Sprintf("%v", problems))
}
