package image

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
)

// Kinds of image source.
const (
	KindRegistry      = "registry"
	KindOCILayout     = "oci"
	KindOCIArchive    = "oci-archive"
	KindDockerArchive = "docker-archive"
)

// Reference is a parsed image reference: a registry's "repo:tag" or
// "repo@sha256:...", or a local source ("oci:/dir[:tag]",
// "oci-archive:/file.tar[:tag]", "docker-archive:/file.tar[:repo:tag]").
type Reference struct {
	// Raw is the reference as written.
	Raw  string
	Kind string
	// Remote is the registry reference (KindRegistry).
	Remote name.Reference
	// Path is the host path of a local source; Tag picks an image in it
	// ("" for its only one), Digest a manifest by digest.
	Path   string
	Tag    string
	Digest string
}

// maxRefLen bounds a reference: a registry's limit is far lower.
const maxRefLen = 4096

var digestRE = regexp.MustCompile(`^sha256:[a-f0-9]{64}$`)

// ParseReference parses an image reference; the errors name the task
// option `image` and what would be right. insecure are the registries
// spoken to over plain HTTP.
func ParseReference(s string, insecure []string) (Reference, error) {
	r := Reference{Raw: s}
	if s == "" {
		return r, fmt.Errorf("image must not be empty: give a reference such as \"registry.example/csi:1.2\"")
	}
	if len(s) > maxRefLen {
		return r, fmt.Errorf("image is %d bytes long; a reference is at most %d", len(s), maxRefLen)
	}
	for _, c := range s {
		if c < 0x21 || c == 0x7f || c > 0x7e {
			return r, fmt.Errorf("image %q has a space, control or non-ASCII character; a reference has none", s)
		}
	}
	for _, kind := range []string{KindOCIArchive, KindDockerArchive, KindOCILayout} {
		rest, ok := strings.CutPrefix(s, kind+":")
		if !ok {
			continue
		}
		r.Kind = kind
		return r, r.parseLocal(rest)
	}
	r.Kind = KindRegistry
	// A missing tag means "latest" and a missing registry Docker Hub, as
	// in Docker.
	ref, err := name.ParseReference(s)
	if err == nil && isInsecure(ref.Context().RegistryStr(), insecure) {
		ref, err = name.ParseReference(s, name.Insecure)
	}
	if err != nil {
		return r, fmt.Errorf("image %q is not a valid reference: write registry/repository:tag or registry/repository@sha256:<64 hex digits>", s)
	}
	r.Remote = ref
	if d, ok := ref.(name.Digest); ok {
		r.Digest = d.DigestStr()
	}
	return r, nil
}

// parseLocal parses "/path[:tag]" or "/path@sha256:...".
func (r *Reference) parseLocal(rest string) error {
	p := rest
	if i := strings.IndexAny(rest, ":@"); i >= 0 {
		p = rest[:i]
		switch sel := rest[i:]; {
		case sel[0] == '@':
			if !digestRE.MatchString(sel[1:]) {
				return fmt.Errorf("image %q: a digest after '@' must be sha256:<64 lowercase hex digits>", r.Raw)
			}
			r.Digest = sel[1:]
		case len(sel) == 1:
			return fmt.Errorf("image %q: the tag after ':' is empty", r.Raw)
		default:
			r.Tag = sel[1:]
		}
	}
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/" {
		return fmt.Errorf("image %q: %s: needs an absolute, clean host path such as \"%s:/srv/images/csi.tar\"", r.Raw, r.Kind, r.Kind)
	}
	r.Path = p
	return nil
}

// Local reports whether the reference is a file or directory on the host.
func (r Reference) Local() bool { return r.Kind != KindRegistry }

// Registry is the registry's host[:port] ("" for a local source).
func (r Reference) Registry() string {
	if r.Remote == nil {
		return ""
	}
	return r.Remote.Context().RegistryStr()
}

func isInsecure(registry string, insecure []string) bool {
	for _, i := range insecure {
		if strings.EqualFold(i, registry) {
			return true
		}
	}
	return false
}

// pinnedTag reports whether the reference is a registry's tag other than
// "latest" (written or implied), which a pull serves from the store when
// an earlier pull of it left the image there.
func (r Reference) pinnedTag() bool {
	t, ok := r.Remote.(name.Tag)
	return r.Kind == KindRegistry && ok && t.TagStr() != "latest"
}
