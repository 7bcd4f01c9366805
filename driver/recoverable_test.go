package driver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/hashicorp/nomad/nomad/structs"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// closedAddr is a 127.0.0.1 address nothing listens on (it did a moment
// ago: a later test may listen there again).
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must.NoError(t, err)
	addr := l.Addr().String()
	must.NoError(t, l.Close())
	return addr
}

// statusRegistry answers /v2/ and every other path with code.
func statusRegistry(t *testing.T, code int) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v2/" {
			return
		}
		w.WriteHeader(code)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// pullError is the error of the image store's pull of ref, as
// StartTask's pull gets it: insecure names the registries spoken to over
// plain HTTP, timeout bounds the pull as image_pull_timeout does.
func pullError(t *testing.T, ref string, insecure []string, localDirs []string, timeout time.Duration) error {
	t.Helper()
	s, err := image.Open(t.TempDir(), image.Options{InsecureRegistries: insecure, LocalDirs: localDirs})
	must.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_, err = s.Pull(ctx, ref, image.PullRequest{})
	must.Error(t, err)
	return err
}

// setupError is the error of a volume setup whose NodeStageVolume
// answers stageErr (nil: answers), through the volume lifecycle's own
// retries (one attempt here: the codes are what matters); plugins are
// the plugins the lookup knows by id, reqs what the task asks for.
func setupError(t *testing.T, stageErr error, plugins map[string]csihook.PluginInfo, reqs ...csihook.VolumeRequest) error {
	t.Helper()
	mnt := mounter.NewFake()
	fake := csihook.NewFakeClient(mnt)
	if stageErr != nil {
		fake.SetError(csihook.MethodNodeStageVolume, stageErr)
	}
	root := t.TempDir()
	m, err := csihook.New(csihook.Config{
		Root: root, Mounter: mnt, Dial: fake.Dial, RetryAttempts: 1, PluginWait: time.Millisecond, NodeName: "n1",
		Lookup: func(id string) (csihook.PluginInfo, error) {
			if p, ok := plugins[id]; ok {
				return p, nil
			}
			return csihook.PluginInfo{}, errors.New("no such plugin")
		},
	})
	must.NoError(t, err)
	t.Cleanup(m.Close)
	if len(reqs) == 0 {
		reqs = []csihook.VolumeRequest{volumeRequest("data", "hp", "v1")}
	}
	_, err = m.Setup(context.Background(), "alloc-1/web/abc", reqs)
	must.Error(t, err)
	return err
}

// unsettledError is the error of a setup of a single-node-writer volume
// whose unpublish for another task of the allocation failed (it is
// retried in the background); with volumeContext set, the request's
// volume context differs from that task's, and the publish is left in place.
func unsettledError(t *testing.T, volumeContext string) error {
	t.Helper()
	mnt := mounter.NewFake()
	fake := csihook.NewFakeClient(mnt)
	m, err := csihook.New(csihook.Config{
		Root: t.TempDir(), Mounter: mnt, Dial: fake.Dial, RetryAttempts: 1, NodeName: "n1",
		Lookup: func(id string) (csihook.PluginInfo, error) { return healthyPlugin(id), nil },
	})
	must.NoError(t, err)
	t.Cleanup(m.Close)
	ctx := t.Context()
	pubs, err := m.Setup(ctx, "alloc-1/app/abc", []csihook.VolumeRequest{volumeRequest("data", "hp", "v1")})
	must.NoError(t, err)
	must.NoError(t, os.MkdirAll(pubs[0].HostPath, 0o750))
	r := volumeRequest("data", "hp", "v1")
	if volumeContext != "" {
		r.Context = map[string]string{"k": volumeContext}
	} else {
		fake.SetError(csihook.MethodNodeUnpublishVolume, status.Error(codes.Internal, "stuck"))
		must.Error(t, m.Teardown(ctx, "alloc-1/app/abc"))
	}
	_, err = m.Setup(ctx, "alloc-1/web/def", []csihook.VolumeRequest{r})
	must.ErrorIs(t, err, csihook.ErrConflict)
	return err
}

// lockWaitError is the error of a setup that waited for its volume while
// another task's stage of it hung in the plugin, until the setup's own
// context ended: by its deadline (passed), or canceled (the driver
// shutting down).
func lockWaitError(t *testing.T, canceled bool) error {
	t.Helper()
	mnt := mounter.NewFake()
	fake := csihook.NewFakeClient(mnt)
	m, err := csihook.New(csihook.Config{
		Root: t.TempDir(), Mounter: mnt, Dial: fake.Dial, RetryAttempts: 1, NodeName: "n1",
		Lookup: func(id string) (csihook.PluginInfo, error) { return healthyPlugin(id), nil },
	})
	must.NoError(t, err)
	t.Cleanup(m.Close)
	release := fake.Hang("v1")
	first := make(chan error, 1)
	go func() {
		_, err := m.Setup(context.Background(), "alloc-1/app/abc", []csihook.VolumeRequest{volumeRequest("data", "hp", "v1")})
		first <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for fake.Count(csihook.MethodNodeStageVolume) == 0 {
		must.True(t, time.Now().Before(deadline), must.Sprint("the first setup's NodeStageVolume never came"))
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	if canceled {
		cancel()
	}
	defer cancel()
	_, err = m.Setup(ctx, "alloc-1/web/def", []csihook.VolumeRequest{volumeRequest("data", "hp", "v1")})
	release()
	must.NoError(t, <-first)
	must.ErrorContains(t, err, "gave up waiting for another operation on volume")
	return err
}

// earlierTeardownWaitError is the error of a start whose earlier
// invocation's volume could not be torn down before the teardown's
// deadline, another task's publish of the volume hung in the plugin
// meanwhile, as endEarlierInvocations returns it.
func earlierTeardownWaitError(t *testing.T) error {
	t.Helper()
	mnt := mounter.NewFake()
	fake := csihook.NewFakeClient(mnt)
	m, err := csihook.New(csihook.Config{
		Root: t.TempDir(), Mounter: mnt, Dial: fake.Dial, RetryAttempts: 1, NodeName: "n1",
		Lookup: func(id string) (csihook.PluginInfo, error) { return healthyPlugin(id), nil },
	})
	must.NoError(t, err)
	t.Cleanup(m.Close)
	shared := volumeRequest("data", "hp", "v1")
	shared.AccessMode = csihook.AccessMultiNodeMultiWriter
	const earlier = "alloc-1/app/old"
	_, err = m.Setup(context.Background(), earlier, []csihook.VolumeRequest{shared})
	must.NoError(t, err)
	release := fake.Hang("v1")
	other := make(chan error, 1)
	go func() {
		_, err := m.Setup(context.Background(), "alloc-2/web/abc", []csihook.VolumeRequest{shared})
		other <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for fake.Count(csihook.MethodNodePublishVolume) < 2 {
		must.True(t, time.Now().Before(deadline), must.Sprint("the other task's NodePublishVolume never came"))
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err = m.Teardown(ctx, earlier)
	release()
	must.NoError(t, <-other)
	must.ErrorContains(t, err, "gave up waiting for another operation on volume")
	return fmt.Errorf("an earlier start of this task (task ID %q) still holds volumes: %w", earlier, err)
}

func volumeRequest(name, plugin, id string) csihook.VolumeRequest {
	return csihook.VolumeRequest{Name: name, PluginID: plugin, VolumeID: id, Destination: "/" + name,
		AccessMode: csihook.AccessSingleNodeWriter, AttachmentMode: csihook.AttachmentFileSystem, Namespace: "default"}
}

func healthyPlugin(id string) csihook.PluginInfo {
	return csihook.PluginInfo{ID: id, Socket: "/run/" + id + ".sock", NodeID: "n1", Healthy: true, StageUnstage: true}
}

// Which start failures Nomad's restart policy may retry: the table holds
// errors the real code paths make (the image store's pulls, the volume
// lifecycle's setups), each as StartTask would return it.
func TestStartError_classifiesRealErrors(t *testing.T) {
	closed := closedAddr(t)
	unavailable := statusRegistry(t, http.StatusServiceUnavailable)
	tooMany := statusRegistry(t, http.StatusTooManyRequests)
	missing := statusRegistry(t, http.StatusNotFound)
	badRequest := statusRegistry(t, http.StatusBadRequest)
	gone := statusRegistry(t, http.StatusGone)
	denied := statusRegistry(t, http.StatusUnauthorized)
	forbidden := statusRegistry(t, http.StatusForbidden)
	tlsSrv := httptest.NewUnstartedServer(http.NotFoundHandler())
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0)
	tlsSrv.StartTLS()
	t.Cleanup(tlsSrv.Close)
	untrusted := strings.TrimPrefix(tlsSrv.URL, "https://")
	localDir := t.TempDir()
	must.NoError(t, os.WriteFile(filepath.Join(localDir, "junk"), []byte("not an image"), 0o644))
	hp := map[string]csihook.PluginInfo{"hp": healthyPlugin("hp")}

	cases := []struct {
		name string
		err  func(t *testing.T) error
		// kind is what the error must be (errors.Is), so that a case
		// cannot pass for another reason than the one it names.
		kind        error
		code        codes.Code
		recoverable bool
	}{
		// Pulls.
		{name: "registry not listening", recoverable: true, kind: image.ErrUnreachable, err: func(t *testing.T) error {
			return pullError(t, closed+"/csi/x:1", []string{closed}, nil, time.Second)
		}},
		{name: "registry 503", recoverable: true, kind: image.ErrUnreachable, err: func(t *testing.T) error {
			return pullError(t, unavailable+"/csi/x:1", []string{unavailable}, nil, time.Second)
		}},
		{name: "registry 429", recoverable: true, kind: image.ErrUnreachable, err: func(t *testing.T) error {
			return pullError(t, tooMany+"/csi/x:1", []string{tooMany}, nil, time.Second)
		}},
		// A registry that refuses the request itself: unreachable to
		// the store (a tag pulled before is served from it), but asking
		// again gets the same answer.
		{name: "registry 400", kind: image.ErrUnreachable, err: func(t *testing.T) error {
			return pullError(t, badRequest+"/csi/x:1", []string{badRequest}, nil, 10*time.Second)
		}},
		{name: "registry 410", kind: image.ErrUnreachable, err: func(t *testing.T) error {
			return pullError(t, gone+"/csi/x:1", []string{gone}, nil, 10*time.Second)
		}},
		{name: "image not found", kind: image.ErrNotFound, err: func(t *testing.T) error {
			return pullError(t, missing+"/csi/x:1", []string{missing}, nil, 10*time.Second)
		}},
		{name: "unauthorized", kind: image.ErrUnauthorized, err: func(t *testing.T) error {
			return pullError(t, denied+"/csi/x:1", []string{denied}, nil, 10*time.Second)
		}},
		{name: "forbidden", kind: image.ErrUnauthorized, err: func(t *testing.T) error {
			return pullError(t, forbidden+"/csi/x:1", []string{forbidden}, nil, 10*time.Second)
		}},
		{name: "untrusted certificate", kind: image.ErrUntrusted, err: func(t *testing.T) error {
			return pullError(t, untrusted+"/csi/x:1", nil, nil, 10*time.Second)
		}},
		{name: "local file outside local_image_dirs", kind: image.ErrNotAllowed, err: func(t *testing.T) error {
			return pullError(t, "oci-archive:/etc/shadow", nil, nil, 10*time.Second)
		}},
		{name: "local image missing", kind: image.ErrNotFound, err: func(t *testing.T) error {
			return pullError(t, "oci:"+filepath.Join(localDir, "none"), nil, []string{localDir}, 10*time.Second)
		}},
		{name: "local image invalid", kind: image.ErrInvalid, err: func(t *testing.T) error {
			return pullError(t, "oci:"+filepath.Join(localDir, "junk"), nil, []string{localDir}, 10*time.Second)
		}},
		{name: "invalid reference", kind: image.ErrInvalid, err: func(t *testing.T) error {
			return pullError(t, "UPPER/case::", nil, nil, 10*time.Second)
		}},

		// Volume setups: the plugin's last answer after the lifecycle's
		// retries.
		{name: "stage Unavailable", recoverable: true, code: codes.Unavailable, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.Unavailable, "restarting"), hp)
		}},
		{name: "stage DeadlineExceeded", recoverable: true, code: codes.DeadlineExceeded, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.DeadlineExceeded, "slow"), hp)
		}},
		{name: "stage ResourceExhausted", recoverable: true, code: codes.ResourceExhausted, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.ResourceExhausted, "busy"), hp)
		}},
		{name: "stage Aborted", recoverable: true, code: codes.Aborted, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.Aborted, "another operation"), hp)
		}},
		{name: "stage InvalidArgument", code: codes.InvalidArgument, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.InvalidArgument, "bad"), hp)
		}},
		{name: "stage NotFound", code: codes.NotFound, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.NotFound, "no volume"), hp)
		}},
		{name: "stage PermissionDenied", code: codes.PermissionDenied, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.PermissionDenied, "no"), hp)
		}},
		{name: "stage FailedPrecondition", code: codes.FailedPrecondition, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.FailedPrecondition, "attached elsewhere"), hp)
		}},
		{name: "stage Internal", code: codes.Internal, err: func(t *testing.T) error {
			return setupError(t, status.Error(codes.Internal, "disk on fire"), hp)
		}},
		{name: "stage answered without a status", code: codes.Unknown, err: func(t *testing.T) error {
			return setupError(t, errors.New("connection reset"), hp)
		}},
		{name: "plugin not running yet", recoverable: true, kind: csihook.ErrPluginNotFound, err: func(t *testing.T) error {
			return setupError(t, nil, nil)
		}},
		{name: "plugin not healthy yet", recoverable: true, kind: csihook.ErrPluginNotFound, err: func(t *testing.T) error {
			sick := healthyPlugin("hp")
			sick.Healthy, sick.HealthDescription = false, "probe failed"
			return setupError(t, nil, map[string]csihook.PluginInfo{"hp": sick})
		}},
		{name: "controller plugin", kind: csihook.ErrInvalid, err: func(t *testing.T) error {
			ctl := healthyPlugin("hp")
			ctl.ControllerOnly = true
			return setupError(t, nil, map[string]csihook.PluginInfo{"hp": ctl})
		}},
		{name: "one plugin not running, another volume refused", kind: csihook.ErrInvalid, err: func(t *testing.T) error {
			ctl := healthyPlugin("ctl")
			ctl.ControllerOnly = true
			err := setupError(t, nil, map[string]csihook.PluginInfo{"ctl": ctl},
				volumeRequest("a", "hp", "v1"), volumeRequest("b", "ctl", "v2"))
			must.ErrorIs(t, err, csihook.ErrPluginNotFound)
			return err
		}},
		{name: "another task's unpublish not settled", recoverable: true, kind: csihook.ErrUnsettled, err: func(t *testing.T) error {
			return unsettledError(t, "")
		}},
		{name: "another task's publish with another context", kind: csihook.ErrConflict, err: func(t *testing.T) error {
			return unsettledError(t, "other")
		}},
		{name: "volume held by another task's stage past the setup's deadline", recoverable: true, kind: csihook.ErrBusy, err: func(t *testing.T) error {
			return lockWaitError(t, false)
		}},
		{name: "volume held by another task's stage, the setup canceled", err: func(t *testing.T) error {
			return lockWaitError(t, true)
		}},
		{name: "earlier start's volume held by another task's publish past the teardown's deadline", recoverable: true, kind: csihook.ErrBusy, err: func(t *testing.T) error {
			return earlierTeardownWaitError(t)
		}},
		{name: "invalid request", kind: csihook.ErrInvalid, err: func(t *testing.T) error {
			bad := volumeRequest("data", "hp", "v1")
			bad.Destination = "relative"
			return setupError(t, nil, hp, bad)
		}},

		// The driver's own.
		{name: "root_dir full", err: func(t *testing.T) error {
			return fmt.Errorf("failed to start task: %w", &fullError{rootDir: "/r", fs: "ext4", what: "space", err: errors.New("no space")})
		}},
		{name: "unknown error", err: func(t *testing.T) error { return errors.New("something else") }},
		{name: "context deadline, not the store's", err: func(t *testing.T) error { return context.DeadlineExceeded }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.err(t)
			if c.kind != nil {
				must.ErrorIs(t, err, c.kind)
			}
			if c.code != codes.OK {
				must.Eq(t, c.code, csihook.Code(err))
			}
			// As StartTask wraps it: the text stays, Nomad's
			// assertion (server.go: err.(structs.Recoverable)) sees
			// whether it may retry.
			wrapped := fmt.Errorf("volume setup: %w", err)
			got := startError(wrapped)
			must.Eq(t, wrapped.Error(), got.Error())
			rec, ok := got.(structs.Recoverable)
			must.Eq(t, c.recoverable, ok && rec.IsRecoverable(), must.Sprintf("error: %v", err))
			must.Eq(t, c.recoverable, structs.IsRecoverable(got))
			must.ErrorIs(t, got, err)
		})
	}
	must.Nil(t, startError(nil))
}

// imageRegistryDriver is a driver that may pull from the registry at
// addr over plain HTTP, the task's root made of nothing (roots counts
// the images it was made from).
func imageRegistryDriver(t *testing.T, addr string) (*testDriver, *int) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the image store sets owners of unpacked files")
	}
	roots := 0
	d := newTestDriver(t, Config{Enabled: true, InsecureRegistries: []string{addr}}, func(d *Driver) {
		d.imageRoot = func(*Config, *drivers.TaskConfig, *TaskConfig, *executor.Spec, *image.Image) error {
			roots++
			return nil
		}
	})
	return d, &roots
}

// A task whose registry is down fails to start recoverably, leaving
// nothing behind, and the same task (the same task ID) starts once the
// registry is up; a grant the operator did not give fails it for good.
func TestStartTask_registryDownIsRecoverable(t *testing.T) {
	addr := closedAddr(t)
	d, roots := imageRegistryDriver(t, addr)
	ref := addr + "/csi/plugin:1.0"
	tc := TaskConfig{Command: "/bin/plugin", Image: ref, ImagePullTimeout: "1s"}
	cfg := taskConfig(t, tc)

	_, _, err := d.StartTask(cfg)
	must.ErrorContains(t, err, `failed to pull image "`+ref+`"`)
	must.ErrorIs(t, err, image.ErrUnreachable)
	var rec *structs.RecoverableError
	must.True(t, errors.As(err, &rec) && err == error(rec), must.Sprintf("not a *structs.RecoverableError: %T %v", err, err))
	must.True(t, rec.IsRecoverable())
	// Through the boundary Nomad is served, as Nomad's plugin server
	// reads it.
	_, _, berr := d.Boundary().StartTask(cfg)
	brec, ok := berr.(structs.Recoverable)
	must.True(t, ok, must.Sprintf("the boundary's error is not recoverable: %T %v", berr, berr))
	must.True(t, brec.IsRecoverable())

	// Nothing was left: no process, no task, no state, no lease.
	must.SliceEmpty(t, d.started)
	_, known := d.tasks.Get(cfg.ID)
	must.False(t, known)
	_, err = os.Stat(d.currentConfig().taskStateDir(cfg.ID))
	must.True(t, os.IsNotExist(err), must.Sprint("the failed start left its state directory"))
	uses, err := os.ReadDir(filepath.Join(image.Dir(d.currentConfig().RootDir), "uses"))
	if !os.IsNotExist(err) {
		must.NoError(t, err)
		must.SliceEmpty(t, uses)
	}

	// The registry comes up where it was: the same start works.
	l, err := net.Listen("tcp", addr)
	must.NoError(t, err)
	srv := &httptest.Server{Listener: l, Config: &http.Server{Handler: registry.New(registry.Logger(log.New(io.Discard, "", 0)))}}
	srv.Start()
	t.Cleanup(srv.Close)
	layer, err := imagebuild.Layer(imagebuild.File("bin/plugin", []byte("#!/bin/sh\n"), 0o755))
	must.NoError(t, err)
	img, err := imagebuild.Build(imagebuild.Spec{Entrypoint: []string{"/bin/plugin"}}, layer)
	must.NoError(t, err)
	tag, err := name.NewTag(ref, name.Insecure)
	must.NoError(t, err)
	must.NoError(t, remote.Write(tag, img))

	_, _, err = d.StartTask(cfg)
	must.NoError(t, err)
	must.Eq(t, 1, *roots)
	must.SliceLen(t, 1, d.started)
	d.procs[0].exit(executor.ExitStatus{})
	must.NoError(t, d.DestroyTask(cfg.ID, true))

	// A privileged task the operator did not grant: final.
	priv := taskConfig(t, TaskConfig{Command: "/bin/plugin", Image: ref, Privileged: true})
	priv.ID = "alloc-2/web/abc"
	_, _, err = d.StartTask(priv)
	must.ErrorContains(t, err, "privileged = true is not allowed")
	_, ok = err.(structs.Recoverable)
	must.False(t, ok, must.Sprintf("a refused grant is recoverable: %T %v", err, err))
	must.False(t, structs.IsRecoverable(err))
	_, _, berr = d.Boundary().StartTask(priv)
	must.False(t, structs.IsRecoverable(berr))
}

// A volume whose plugin is not running yet fails the start recoverably,
// with nothing of the volume left; the same start works once the plugin
// is up.
func TestStartTask_pluginNotRunningYetIsRecoverable(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll}, func(d *Driver) {
		d.pluginWait = 50 * time.Millisecond
	})
	fp := withFakePlugins(t, d)
	work := volumeWorkload(t, "alloc-w", "first")

	_, _, err := d.StartTask(work)
	must.ErrorContains(t, err, `CSI plugin "hp" is not running on node`)
	must.True(t, structs.IsRecoverable(err), must.Sprintf("%T %v", err, err))
	must.Eq(t, 0, fp.vols.Count(csihook.MethodNodeStageVolume))
	must.SliceEmpty(t, d.started)
	_, err = os.Stat(d.currentConfig().taskStateDir(work.ID))
	must.True(t, os.IsNotExist(err), must.Sprint("the failed start left its state directory"))
	must.Eq(t, 0, journalTasks(t, d))

	plugin := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	_, _, err = d.StartTask(plugin)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	_, _, err = d.StartTask(work)
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
	must.Eq(t, 1, journalTasks(t, d))
	must.NoError(t, d.DestroyTask(work.ID, true))
	must.Eq(t, 0, journalTasks(t, d))
}

// A publish the plugin keeps answering Unavailable fails the start
// recoverably once the lifecycle's retries are spent, with nothing of the
// volume left (no mount, no journal record); the task's next start, under
// the new task ID Nomad gives each start, sets the volume up.
func TestStartTask_pluginUnavailableIsRecoverable(t *testing.T) {
	d := newTestDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll})
	fp := withFakePlugins(t, d)
	plugin := jobTask(t, TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}, "alloc-p", "default", "plugin")
	_, _, err := d.StartTask(plugin)
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	mnt := d.mounter.(*mounter.Fake)
	before, err := mnt.List()
	must.NoError(t, err)
	started := len(d.started)

	fp.vols.SetError(csihook.MethodNodePublishVolume, status.Error(codes.Unavailable, "plugin restarting"))
	first := volumeWorkload(t, "alloc-w", "first")
	_, _, err = d.StartTask(first)
	must.ErrorContains(t, err, `failed to publish volume "data"`)
	must.ErrorContains(t, err, "Unavailable: plugin restarting")
	must.True(t, structs.IsRecoverable(err), must.Sprintf("%T %v", err, err))
	must.Greater(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume), must.Sprint("the lifecycle did not retry"))
	must.Eq(t, 0, journalTasks(t, d))
	after, err := mnt.List()
	must.NoError(t, err)
	must.Eq(t, before, after, must.Sprint("the failed start left mounts"))
	must.Eq(t, started, len(d.started))
	_, err = os.Stat(d.currentConfig().taskStateDir(first.ID))
	must.True(t, os.IsNotExist(err), must.Sprint("the failed start left its state directory"))
	_, targeted := d.eventTargets.Load(first.ID)
	must.False(t, targeted, must.Sprint("the failed start left its event target"))

	fp.vols.SetError(csihook.MethodNodePublishVolume, nil)
	second := volumeWorkload(t, "alloc-w", "second")
	_, _, err = d.StartTask(second)
	must.NoError(t, err)
	must.Eq(t, 1, journalTasks(t, d))
	must.NoError(t, d.DestroyTask(second.ID, true))
	must.Eq(t, 0, journalTasks(t, d))
}

// Failures joined together (a volume setup's checks, the teardown of an
// earlier start's volumes) pass only when each of them passes: one that
// is of no kind the driver knows (a journal write the disk refused) is
// not explained by a plugin restarting beside it, and a restart would
// meet it again.
func TestStartError_joinedFailuresPassOnlyWhenEachPasses(t *testing.T) {
	hp := map[string]csihook.PluginInfo{"hp": healthyPlugin("hp")}
	unavailable := setupError(t, status.Error(codes.Unavailable, "restarting"), hp)
	notRunning := setupError(t, nil, nil)
	journal := &os.PathError{Op: "write", Path: "/var/lib/csi/journal/wal", Err: syscall.ENOSPC}
	refused := setupError(t, status.Error(codes.InvalidArgument, "bad"), hp)

	cases := []struct {
		name        string
		err         error
		recoverable bool
	}{
		{name: "two passing failures", recoverable: true, err: errors.Join(unavailable, notRunning)},
		{name: "a passing failure wrapped twice", recoverable: true,
			err: fmt.Errorf("an earlier start of this task still holds volumes: %w", fmt.Errorf("retrying in the background: %w", unavailable))},
		{name: "a passing failure beside a refusal", err: errors.Join(unavailable, refused)},
		{name: "a passing failure beside one of no known kind", err: errors.Join(unavailable, journal)},
		{name: "the same, wrapped", err: fmt.Errorf("an earlier start of this task (task ID %q) still holds volumes: %w",
			"alloc-1/web/abc", fmt.Errorf("failed to tear down the volumes of task %q, retrying in the background: %w",
				"alloc-1/web/abc", errors.Join(unavailable, journal)))},
		{name: "the same, a level down", err: errors.Join(errors.Join(notRunning, journal), unavailable)},
		{name: "one of no known kind alone", err: errors.Join(journal)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := startError(c.err)
			must.Eq(t, c.err.Error(), got.Error())
			must.Eq(t, c.recoverable, structs.IsRecoverable(got), must.Sprintf("error: %v", c.err))
		})
	}
}
