package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
)

func frameOf(t *testing.T, m proto.Message) frame {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A publish makes the target (a directory, or a file for a block volume),
// an unpublish removes it, twice is no error, and other calls touch
// nothing.
func TestTarget(t *testing.T) {
	dir := t.TempDir()
	mount := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
	block := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}
	for _, tc := range []struct {
		name  string
		cap   *csi.VolumeCapability
		isDir bool
	}{{"mount", mount, true}, {"block", block, false}} {
		t.Run(tc.name, func(t *testing.T) {
			target := filepath.Join(dir, tc.name)
			pub := frameOf(t, &csi.NodePublishVolumeRequest{VolumeId: "1", TargetPath: target, VolumeCapability: tc.cap})
			for range 2 {
				if err := handleTarget(publish, pub); err != nil {
					t.Fatalf("publish: %v", err)
				}
				fi, err := os.Lstat(target)
				if err != nil {
					t.Fatalf("no target after a publish: %v", err)
				}
				if fi.IsDir() != tc.isDir {
					t.Fatalf("target is a directory: %v, want %v", fi.IsDir(), tc.isDir)
				}
			}
			unpub := frameOf(t, &csi.NodeUnpublishVolumeRequest{VolumeId: "1", TargetPath: target})
			for range 2 {
				if err := handleTarget(unpublish, unpub); err != nil {
					t.Fatalf("unpublish: %v", err)
				}
				if _, err := os.Lstat(target); !os.IsNotExist(err) {
					t.Fatalf("target left after an unpublish: %v", err)
				}
			}
		})
	}
	other := filepath.Join(dir, "other")
	stage := frameOf(t, &csi.NodeStageVolumeRequest{VolumeId: "1", StagingTargetPath: other, VolumeCapability: mount})
	if err := handleTarget("/csi.v1.Node/NodeStageVolume", stage); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(other); !os.IsNotExist(err) {
		t.Fatalf("a stage made its path: %v", err)
	}
}
