package image

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// BenchmarkWarmPull is the store's part of a warm start: a pull of an
// image the store has, with a task's credentials and lease, by tag (served
// from the store, the registry not asked) and by digest.
//
//	go test -run '^$' -bench WarmPull ./driver/image/
//
// It needs root (the store sets owners as it unpacks).
func BenchmarkWarmPull(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: the store sets owners as it unpacks")
	}
	reg := newTagRegistry(b)
	s, err := Open(b.TempDir(), Options{InsecureRegistries: []string{reg.host}})
	if err != nil {
		b.Fatal(err)
	}
	img := mustImage(b, imagebuild.Spec{Env: []string{"V=1"}}, baseLayer(b))
	tag := reg.host + "/csi/plugin:1.2"
	d := reg.push(b, tag, img)
	ctx := context.Background()
	auth := &Credentials{Username: "u", Password: "p"}
	for name, ref := range map[string]string{"tag": tag, "digest": reg.host + "/csi/plugin@" + d} {
		if _, err := s.Pull(ctx, ref, PullRequest{Auth: auth}); err != nil {
			b.Fatal(err)
		}
		b.Run(name, func(b *testing.B) {
			before := reg.hits.Load()
			for i := 0; i < b.N; i++ {
				if _, err := s.Pull(ctx, ref, PullRequest{Auth: auth, Use: &Use{TaskID: fmt.Sprint(i)}}); err != nil {
					b.Fatal(err)
				}
			}
			if n := reg.hits.Load() - before; n != 0 {
				b.Fatalf("%d requests reached the registry on warm pulls", n)
			}
		})
	}
}
