package imagebuild

import (
	"archive/tar"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/shoenig/test/must"
)

// The fixture's image carries each tool with its interpreter and
// libraries, at the paths the loader looks for them.
func TestFixturePluginHasWhatItRuns(t *testing.T) {
	img, err := FixturePlugin("/bin/true")
	must.NoError(t, err)
	layers, err := img.Layers()
	must.NoError(t, err)
	must.SliceLen(t, 2, layers)
	names := map[string]bool{}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		must.NoError(t, err)
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			must.NoError(t, err)
			names["/"+h.Name] = true
		}
		rc.Close()
	}
	for _, tool := range append(FixtureTools, FixturePluginPath) {
		must.True(t, names[tool], must.Sprintf("no %s", tool))
		deps, err := elfDeps(tool)
		if tool == FixturePluginPath {
			deps, err = elfDeps("/bin/true")
		}
		must.NoError(t, err)
		for _, d := range deps {
			must.True(t, names[d], must.Sprintf("%s needs %s, not in the image", tool, d))
		}
	}
	cf, err := img.ConfigFile()
	must.NoError(t, err)
	must.Eq(t, []string{FixturePluginPath}, cf.Config.Entrypoint)

	dir := filepath.Join(t.TempDir(), "layout")
	must.NoError(t, WriteLayout(dir, "1.0", img))
	p, err := layout.FromPath(dir)
	must.NoError(t, err)
	idx, err := p.ImageIndex()
	must.NoError(t, err)
	m, err := idx.IndexManifest()
	must.NoError(t, err)
	must.Eq(t, "1.0", m.Manifests[0].Annotations[refName])
	_, err = os.Stat(filepath.Join(dir, "oci-layout"))
	must.NoError(t, err)
}
