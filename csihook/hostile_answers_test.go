package csihook

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
)

// oversizedAnswers is a plugin any job can run (a csi_plugin block needs no
// grant) that answers CreateVolume and ControllerPublishVolume with what
// it likes, up to what gRPC lets through (4 MiB a message).
type oversizedAnswers struct {
	*FakeClient
	volumeID       string
	volumeContext  map[string]string
	publishContext map[string]string
}

func (o *oversizedAnswers) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	resp, err := o.FakeClient.CreateVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	if o.volumeID != "" {
		resp.Volume.VolumeId = o.volumeID
	}
	if o.volumeContext != nil {
		resp.Volume.VolumeContext = o.volumeContext
	}
	return resp, nil
}

func (o *oversizedAnswers) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	resp, err := o.FakeClient.ControllerPublishVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	if o.publishContext != nil {
		resp.PublishContext = o.publishContext
	}
	return resp, nil
}

// A plugin's answers are held to the limits a job's own fields are
// (MaxIDBytes, MaxMapBytes): they are kept in the journal (on disk in
// root_dir, in the driver's memory, read back on every start; a created
// volume's record for good), repeated in every record of the volume and
// its tasks, and the volume id goes into events Nomad keeps in its state
// and into the agent's log. A plugin answering 4 MiB per volume, 64
// volumes a task, would have grown them by gigabytes. The answer is
// refused with an error naming the field and the limit, and nothing of it
// is kept.
func TestHostileAnswers_SizesBounded(t *testing.T) {
	big := strings.Repeat("v", 4<<20-64<<10)
	cases := []struct {
		name   string
		answer oversizedAnswers
		create bool
		want   string
	}{
		{"create volume_id", oversizedAnswers{volumeID: big}, true,
			"CreateVolume answered a volume_id of 4128768 bytes"},
		{"create volume_context", oversizedAnswers{volumeContext: map[string]string{"k": big}}, true,
			"CreateVolume answered a volume_context of 4128769 bytes"},
		{"publish_context", oversizedAnswers{publishContext: map[string]string{"k": big}}, false,
			"ControllerPublishVolume answered a publish_context of 4128769 bytes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			plugin := tc.answer
			h := newHarness(t, func(c *Config) {
				c.Dial = func(string) (Client, error) { return &plugin, nil }
			})
			plugin.FakeClient = h.fake
			r := req("data", "vol1", "/data")
			if tc.create {
				r.Create = &CreateRequest{}
			}
			_, err := h.m.Setup(context.Background(), "t1", []VolumeRequest{r})
			must.ErrorContains(t, err, tc.want)
			must.Eq(t, codes.Internal, Code(err))
			must.LessEq(t, 4*MaxErrorMessage, len(err.Error()))
			h.waitIdle()

			// Nothing of the answer was kept: not in the journal (the
			// created record included), not in an event, not in the log.
			must.Eq(t, []string(nil), h.journalRecords())
			must.MapEmpty(t, diskJournal(t, filepath.Join(h.root, "journal")).created)
			fi, err := os.Stat(filepath.Join(h.root, "journal", logName))
			must.NoError(t, err)
			must.Less(t, int64(len(big)), fi.Size())
			h.mu.Lock()
			for _, e := range h.events {
				n := len(e.Msg)
				for k, v := range e.Ann {
					n += len(k) + len(v)
				}
				must.LessEq(t, 8*MaxErrorMessage, n, must.Sprint(e.Msg[:min(len(e.Msg), 200)]))
			}
			h.mu.Unlock()
			must.Less(t, 64<<10, len(h.logs.String()))
			must.Eq(t, []string(nil), h.mountPaths())
			if !tc.create {
				// The attachment the refused answer came with is undone.
				must.Eq(t, h.fake.Count(MethodControllerPublishVolume), h.fake.Count(MethodControllerUnpublishVolume))
			}
		})
	}
}
