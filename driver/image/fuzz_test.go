package image

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

func FuzzParseReference(f *testing.F) {
	for _, s := range []string{"registry.example/csi:1.2", "busybox", "127.0.0.1:5000/a/b@sha256:" + strings.Repeat("a", 64),
		"oci:/srv/x:1", "oci-archive:/a.tar@sha256:" + strings.Repeat("b", 64), "docker-archive:/a.tar:r/x:1", "oci:/a/../b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseReference(s, []string{"reg.internal:5000"})
		if err != nil {
			return
		}
		if r.Local() {
			if !filepath.IsAbs(r.Path) || filepath.Clean(r.Path) != r.Path || strings.ContainsAny(r.Path, ":@") {
				t.Fatalf("%q: local path %q is not absolute, clean and plain", s, r.Path)
			}
			return
		}
		if r.Registry() == "" || r.Remote == nil {
			t.Fatalf("%q: a registry reference without a registry", s)
		}
	})
}

// FuzzUnpackTar unpacks any tar stream: whatever it holds, nothing is
// written beside the layer's directory. make unit replays its seeds; it is
// not in make fuzz: under go test -fuzz its workers stall here (a few
// executions a minute, on a loaded machine), where the same target built
// without coverage runs hundreds a second.
func FuzzUnpackTar(f *testing.F) {
	seeds := [][]imagebuild.Entry{
		{imagebuild.Dir("a", 0o755), imagebuild.File("a/b", []byte("x"), 0o644), imagebuild.Whiteout("a/c"), imagebuild.Opaque("a")},
		{imagebuild.Symlink("s", "/"), imagebuild.File("s/x", []byte("x"), 0o644)},
		{imagebuild.Symlink("s", ".."), imagebuild.Hardlink("h", "s/sentinel/f")},
		{imagebuild.File("../x", []byte("x"), 0o644)},
		{imagebuild.File("x", []byte("x"), 0o644), imagebuild.Hardlink("y", "x"), imagebuild.Symlink("x", "y")},
	}
	for _, s := range seeds {
		b, err := imagebuild.Tar(s...)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		layer, sentinel := filepath.Join(base, "layer"), filepath.Join(base, "sentinel")
		for _, d := range []string{layer, sentinel} {
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		_, _ = unpackTar(strings.NewReader(string(data)), layer, nil, nil)
		for _, d := range []string{base, sentinel} {
			entries, err := os.ReadDir(d)
			if err != nil {
				t.Fatal(err)
			}
			if d == sentinel && len(entries) != 0 || d == base && len(entries) != 2 {
				t.Fatalf("the layer wrote beside its directory: %s holds %v", d, entries)
			}
		}
	})
}
