package image

import (
	"context"
	"io"
	"log"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// One image pulled at once from sources that name it differently (a
// registry, an OCI archive, an OCI layout), as tasks of different jobs
// start it side by side before the node has it: every pull gets the
// image, whole, and the store holds each layer once, with nothing left in
// its tmp/.
func TestPullOneImageFromThreeSourcesAtOnce(t *testing.T) {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	for round := 0; round < 10; round++ {
		f := newFixture(t)
		img := mustImage(t, imagebuild.Spec{Cmd: []string{"/bin/true"}}, baseLayer(t), mustLayer(t, imagebuild.File("bin/true", []byte("t"), 0o755)))
		oa := filepath.Join(f.images, "app.oci.tar")
		must.NoError(t, imagebuild.WriteOCIArchive(oa, "v1", img))
		reg := host + "/csi/app:v1"
		tag, err := name.NewTag(reg, name.Insecure)
		must.NoError(t, err)
		must.NoError(t, remote.Write(tag, img))
		store, err := Open(f.root, Options{LocalDirs: []string{f.images}, InsecureRegistries: []string{host}})
		must.NoError(t, err)
		refs := []string{reg, "oci-archive:" + oa + ":v1", f.layout(t, "app", "v1", img)}
		want, err := img.Digest()
		must.NoError(t, err)
		var wg sync.WaitGroup
		got := make([]*Image, 2*len(refs))
		errs := make([]error, len(got))
		for i := range got {
			wg.Go(func() { got[i], errs[i] = store.Pull(context.Background(), refs[i%len(refs)], PullRequest{}) })
		}
		wg.Wait()
		for i := range got {
			must.NoError(t, errs[i], must.Sprintf("round %d, pull %d of %s", round, i, refs[i%len(refs)]))
			must.Eq(t, want.String(), got[i].Digest)
			must.Eq(t, got[0].Layers, got[i].Layers)
		}
		assertTmpClean(t, store)
	}
}
