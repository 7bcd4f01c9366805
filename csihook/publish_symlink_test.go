package csihook

import (
	"context"
	"errors"
	"os"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
)

// symlinkPublisher is a plugin that publishes by leaving target_path a
// symbolic link (to host, outside the driver's directories) instead of a
// mount there.
type symlinkPublisher struct {
	*FakeClient
	host string
}

func (s *symlinkPublisher) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if _, err := s.FakeClient.NodePublishVolume(ctx, req); err != nil {
		return nil, err
	}
	_ = os.Remove(req.GetTargetPath())
	if err := os.Symlink(s.host, req.GetTargetPath()); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// A target_path the plugin left a symbolic link is refused: the task's
// bind of the target would follow it to whatever it names on the host
// (a plugin that publishes by symlink into a volume the job writes lets
// the job choose). Setup fails naming the plugin, and undoes the volume.
func TestSetup_PublishTargetSymlinkRefused(t *testing.T) {
	host := t.TempDir()
	var h *harness
	h = newHarness(t, func(c *Config) {
		c.Dial = func(string) (Client, error) { return &symlinkPublisher{FakeClient: h.fake, host: host}, nil }
	})
	h.m.Close()
	h.m = h.newManager()
	ctx := context.Background()

	_, err := h.m.Setup(ctx, "task-a", []VolumeRequest{req("data", "vol1", "/data")})
	var oe *OpError
	must.True(t, errors.As(err, &oe), must.Sprintf("error %v", err))
	must.Eq(t, MethodNodePublishVolume, oe.Method)
	must.StrContains(t, err.Error(), "symbolic link")
	must.Eq(t, []string{MethodControllerPublishVolume, MethodNodeStageVolume, MethodNodePublishVolume,
		MethodNodeUnpublishVolume, MethodNodeUnstageVolume, MethodControllerUnpublishVolume}, h.fake.Methods())
	must.SliceEmpty(t, h.journalRecords())
	must.Eq(t, 0, h.m.Users("p", "vol1"))
	entries, err := os.ReadDir(host)
	must.NoError(t, err)
	must.SliceEmpty(t, entries)
}
