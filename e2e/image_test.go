//go:build e2e

package e2e

// Image pulls against a real registry (Debian's docker-registry with TLS
// from a test CA and htpasswd auth, behind a counting proxy), with images
// built here from host files: by the operator's CLI (`images pull`), which
// runs the same store as the driver, and by the driver inside a real agent,
// whose task events say what happened.

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/shoenig/test/must"
	"github.com/shoenig/test/wait"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
	"github.com/nomad-driver-csi/nomad-driver-csi/e2e/imagebuild"
)

// driverCLI runs the driver binary as an operator would (no plugin
// handshake), with stdin.
func driverCLI(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	return driverCLIEnv(t, nil, stdin, args...)
}

// driverCLIEnv is driverCLI with more environment (KEY=VALUE).
func driverCLIEnv(t *testing.T, env []string, stdin string, args ...string) (string, string, error) {
	t.Helper()
	cmd := imageCLICommand(t, args...)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	return out.String(), errOut.String(), err
}

func imageCLICommand(t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	root, err := RepoRoot()
	must.NoError(t, err)
	cmd := exec.Command(filepath.Join(PluginDir(root), "nomad-driver-csi"), args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NOMAD_PLUGIN_MAGIC_COOKIE=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	return cmd
}

// fixtureImage is the fixture plugin's image (its tools and libraries from
// this host).
func fixtureImage(t *testing.T) v1.Image {
	t.Helper()
	root, err := RepoRoot()
	must.NoError(t, err)
	img, err := imagebuild.FixturePlugin(filepath.Join(CSIBinDir(root), "csi-fixture"))
	must.NoError(t, err)
	return img
}

// registryWithFixture starts a registry and pushes the fixture plugin's
// image to it as csi/fixture:1.0, the reference it returns.
func registryWithFixture(t *testing.T) (*TestRegistry, v1.Image, string) {
	t.Helper()
	reg := StartRegistry(t)
	img := fixtureImage(t)
	ref, err := reg.Push("csi/fixture:1.0", img)
	must.NoError(t, err)
	return reg, img, ref
}

// storeState lists what an image store under root holds: records,
// layers, configurations, leases and what tmp/ holds but lock files.
func storeState(t *testing.T, root string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, d := range []string{"manifests", "layers", "configs", "uses", "tmp"} {
		entries, err := os.ReadDir(filepath.Join(image.Dir(root), d))
		if os.IsNotExist(err) {
			continue
		}
		must.NoError(t, err)
		for _, e := range entries {
			if d == "tmp" && strings.HasSuffix(e.Name(), ".lock") {
				continue
			}
			out[d] = append(out[d], e.Name())
		}
	}
	return out
}

func listImages(t *testing.T, root string) []image.Info {
	t.Helper()
	out, errOut, err := driverCLI(t, "", "images", "-json", "-root-dir", root)
	must.NoError(t, err, must.Sprint(errOut))
	var v struct{ Images []image.Info }
	must.NoError(t, json.Unmarshal([]byte(out), &v))
	return v.Images
}

// sameFile checks that a file of an unpacked layer is the host's file.
func sameFile(t *testing.T, layers []string, inImage, host string) {
	t.Helper()
	want, err := os.ReadFile(host)
	must.NoError(t, err)
	for i := len(layers) - 1; i >= 0; i-- {
		if got, err := os.ReadFile(filepath.Join(layers[i], inImage)); err == nil {
			must.True(t, bytes.Equal(want, got), must.Sprintf("%s differs from %s", inImage, host))
			return
		}
	}
	t.Fatalf("no layer has %s", inImage)
}

func TestImageRegistryPull(t *testing.T) {
	reg, img, ref := registryWithFixture(t)
	digest, err := img.Digest()
	must.NoError(t, err)
	good := reg.DockerConfig(t, reg.Password)
	bad := reg.DockerConfig(t, "wrong-"+reg.Password)
	newRoot := func() string { return t.TempDir() }
	pull := func(root string, args ...string) (string, string, error) {
		return driverCLI(t, "", append([]string{"images", "pull", "-root-dir", root, "-timeout", "2m"}, args...)...)
	}

	t.Run("tls and auth", func(t *testing.T) {
		root := newRoot()
		out, errOut, err := pull(root, "-registry-ca-file", reg.CAFile, "-auth-config", good, ref)
		must.NoError(t, err, must.Sprint(errOut))
		must.StrContains(t, out, "Pulled "+ref)
		list := listImages(t, root)
		must.SliceLen(t, 1, list)
		must.Eq(t, digest.String(), list[0].Digest)
		must.Eq(t, []string{ref}, list[0].Refs)
		// The layers hold the host's files, byte for byte.
		out, errOut, err = pull(root, "-json", "-registry-ca-file", reg.CAFile, "-auth-config", good, ref)
		must.NoError(t, err, must.Sprint(errOut))
		var got image.Image
		must.NoError(t, json.Unmarshal([]byte(out), &got))
		for _, f := range imagebuild.FixtureTools {
			sameFile(t, got.Layers, f, f)
		}
		// A user and password on stdin, as a task's auth block.
		root2 := newRoot()
		_, errOut, err = driverCLI(t, reg.Password+"\n", "images", "pull", "-root-dir", root2, "-registry-ca-file", reg.CAFile,
			"-username", reg.Username, "-password-stdin", ref)
		must.NoError(t, err, must.Sprint(errOut))
		must.SliceLen(t, 1, listImages(t, root2))
	})

	t.Run("by digest, with SSL_CERT_FILE", func(t *testing.T) {
		// Go's system roots: SSL_CERT_FILE names the CA, no
		// registry_ca_file.
		root := newRoot()
		byDigest := reg.Host + "/csi/fixture@" + digest.String()
		env := []string{"SSL_CERT_FILE=" + reg.CAFile}
		_, errOut, err := driverCLIEnv(t, env, "", "images", "pull", "-root-dir", root, "-auth-config", good, byDigest)
		must.NoError(t, err, must.Sprint(errOut))
		list := listImages(t, root)
		must.SliceLen(t, 1, list)
		must.Eq(t, digest.String(), list[0].Digest)
		// Present by digest: the registry is not asked again.
		reg.ResetRequests()
		_, errOut, err = driverCLIEnv(t, env, "", "images", "pull", "-root-dir", root, "-auth-config", good, byDigest)
		must.NoError(t, err, must.Sprint(errOut))
		must.Eq(t, 0, reg.Requests("GET", "/v2/"))
		// A digest the registry does not have.
		other := reg.Host + "/csi/fixture@sha256:" + strings.Repeat("0", 64)
		_, errOut, err = driverCLIEnv(t, env, "", "images", "pull", "-root-dir", root, "-auth-config", good, other)
		must.Error(t, err)
		must.StrContains(t, errOut, "not found")
	})

	// Each failure has its own error, names the reference and the fix,
	// and leaves nothing in the store.
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"wrong credentials", []string{"-registry-ca-file", reg.CAFile, "-auth-config", bad, ref},
			[]string{"refused the credentials (401 Unauthorized)", "auth"}},
		{"no credentials", []string{"-registry-ca-file", reg.CAFile, ref}, []string{"refused the credentials"}},
		{"unknown tag", []string{"-registry-ca-file", reg.CAFile, "-auth-config", good, reg.Host + "/csi/fixture:9.9"},
			[]string{"not found", "csi/fixture:9.9"}},
		{"unknown repository", []string{"-registry-ca-file", reg.CAFile, "-auth-config", good, reg.Host + "/csi/none:1"},
			[]string{"not found"}},
		{"untrusted certificate", []string{"-auth-config", good, ref}, []string{"not trusted", "registry_ca_file"}},
		{"wrong platform", []string{"-registry-ca-file", reg.CAFile, "-auth-config", good, pushForeign(t, reg)},
			[]string{"linux/s390x", "use an image built for"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := newRoot()
			_, errOut, err := pull(root, tc.args...)
			must.Error(t, err)
			t.Logf("%s: %s", tc.name, strings.TrimSpace(errOut))
			for _, w := range tc.want {
				must.StrContains(t, errOut, w)
			}
			must.StrContains(t, errOut, tc.args[len(tc.args)-1])
			must.StrNotContains(t, errOut, reg.Password)
			must.MapEmpty(t, storeState(t, root))
		})
	}

	t.Run("digest mismatch", func(t *testing.T) {
		// An image of its own, with a layer the registry's storage then
		// corrupts: same size, one byte flipped.
		tref, _, layer := pushOnFixtureBase(t, reg, "csi/tampered:1", imagebuild.File("data", randomBytes(t, 1<<20), 0o644))
		ld, err := layer.Digest()
		must.NoError(t, err)
		b, err := os.ReadFile(reg.BlobFile(ld.String()))
		must.NoError(t, err)
		b[len(b)/2] ^= 0xff
		must.NoError(t, os.WriteFile(reg.BlobFile(ld.String()), b, 0o644))
		root := newRoot()
		_, errOut, err := pull(root, "-registry-ca-file", reg.CAFile, "-auth-config", good, tref)
		must.Error(t, err)
		must.StrContains(t, errOut, "does not match its digest")
		must.StrContains(t, errOut, tref)
		must.MapEmpty(t, storeState(t, root))
	})

	t.Run("registry down", func(t *testing.T) {
		reg.Stop()
		defer func() { must.NoError(t, reg.Start()) }()
		// Straight to the registry's own port, which refuses
		// connections now (the proxy would answer 502).
		direct := strings.Replace(ref, reg.Host, reg.Direct, 1)
		root := newRoot()
		start := time.Now()
		out, errOut, err := driverCLI(t, reg.Password+"\n", "images", "pull", "-root-dir", root, "-registry-ca-file", reg.CAFile,
			"-username", reg.Username, "-password-stdin", direct)
		must.Error(t, err)
		must.StrContains(t, errOut, "unreachable")
		must.StrContains(t, errOut, "connection refused")
		must.StrContains(t, errOut, direct)
		// Retried, with capped backoff, and said so.
		must.StrContains(t, out, "retrying in")
		must.StrContains(t, out, "attempt 5 of 5")
		must.Less(t, 90*time.Second, time.Since(start))
		must.MapEmpty(t, storeState(t, root))
	})
}

// pushForeign pushes an image for another platform only and returns its
// reference.
func pushForeign(t *testing.T, reg *TestRegistry) string {
	t.Helper()
	layer, err := imagebuild.Layer(imagebuild.File("x", []byte("x"), 0o644))
	must.NoError(t, err)
	img, err := imagebuild.Build(imagebuild.Spec{Platform: &v1.Platform{OS: "linux", Architecture: "s390x"}}, layer)
	must.NoError(t, err)
	idx, err := imagebuild.Index(img)
	must.NoError(t, err)
	ref, err := reg.Push("csi/foreign:1", idx)
	must.NoError(t, err)
	return ref
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	must.NoError(t, err)
	return b
}

// pushOnFixtureBase pushes, as ref, an image of the fixture image's base
// layer and a layer of files above it; it returns the full reference, the
// image and its own layer.
func pushOnFixtureBase(t *testing.T, reg *TestRegistry, ref string, files ...imagebuild.Entry) (string, v1.Image, v1.Layer) {
	t.Helper()
	base, err := fixtureImage(t).Layers()
	must.NoError(t, err)
	layer, err := imagebuild.Layer(files...)
	must.NoError(t, err)
	img, err := imagebuild.Build(imagebuild.Spec{}, base[0], layer)
	must.NoError(t, err)
	full, err := reg.Push(ref, img)
	must.NoError(t, err)
	return full, img, layer
}

// blobsOf lists an image's blob digests: configuration and layers.
func blobsOf(t *testing.T, img v1.Image) []string {
	t.Helper()
	m, err := img.Manifest()
	must.NoError(t, err)
	out := []string{m.Config.Digest.String()}
	for _, l := range m.Layers {
		out = append(out, l.Digest.String())
	}
	return out
}

func TestImageConcurrentPullsFetchOnce(t *testing.T) {
	reg, img, ref := registryWithFixture(t)
	good := reg.DockerConfig(t, reg.Password)
	root := t.TempDir()
	// Slow enough that the pulls overlap.
	reg.SetBlobDelay(2 * time.Millisecond)
	reg.ResetRequests()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	outs := make([]string, 3)
	for i := range errs {
		wg.Go(func() {
			_, outs[i], errs[i] = driverCLI(t, "", "images", "pull", "-root-dir", root, "-registry-ca-file", reg.CAFile, "-auth-config", good, ref)
		})
	}
	wg.Wait()
	for i := range errs {
		must.NoError(t, errs[i], must.Sprint(outs[i]))
	}
	// Three processes, one store: each blob was fetched once.
	for _, b := range blobsOf(t, img) {
		must.Eq(t, 1, reg.Requests("GET", "/blobs/"+b), must.Sprintf("blob %s", b))
	}
	must.SliceLen(t, 1, listImages(t, root))
	st := storeState(t, root)
	must.MapNotContainsKey(t, st, "tmp")
	must.SliceLen(t, 2, st["layers"])
}

func TestImageKilledPullIsRedone(t *testing.T) {
	reg := StartRegistry(t)
	ref, img, big := pushOnFixtureBase(t, reg, "csi/big:1", imagebuild.File("big", randomBytes(t, 8<<20), 0o644))
	good := reg.DockerConfig(t, reg.Password)
	root := t.TempDir()
	diff, err := big.DiffID()
	must.NoError(t, err)
	partial := func() string { return partialLayer(image.Dir(root), diff.Hex) }

	// 8 MiB at 32 KiB per 20 ms: about 5 s; killed once the layer is
	// being unpacked.
	reg.SetBlobDelay(20 * time.Millisecond)
	cmd := imageCLICommand(t, "images", "pull", "-root-dir", root, "-registry-ca-file", reg.CAFile, "-auth-config", good, ref)
	must.NoError(t, cmd.Start())
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		entries, err := os.ReadDir(partial())
		return err == nil && len(entries) > 0
	}), wait.Timeout(60*time.Second), wait.Gap(20*time.Millisecond)))
	must.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	err = cmd.Wait()
	killed = true
	must.Error(t, err)

	// Nothing half-made is an image, or a layer.
	must.SliceEmpty(t, listImages(t, root))
	st := storeState(t, root)
	must.SliceNotContains(t, st["layers"], diff.Hex)
	must.MapNotContainsKey(t, st, "manifests")

	reg.SetBlobDelay(0)
	out, errOut, err := driverCLI(t, "", "images", "pull", "-json", "-root-dir", root, "-registry-ca-file", reg.CAFile, "-auth-config", good, ref)
	must.NoError(t, err, must.Sprint(errOut))
	var got image.Image
	must.NoError(t, json.Unmarshal([]byte(out), &got))
	d, err := img.Digest()
	must.NoError(t, err)
	must.Eq(t, d.String(), got.Digest)
	fi, err := os.Stat(filepath.Join(got.Layers[1], "big"))
	must.NoError(t, err)
	must.Eq(t, int64(8<<20), fi.Size())
	must.MapNotContainsKey(t, storeState(t, root), "tmp")
}

// partialLayer is the tree a pull is unpacking the layer diffHex into, in
// the store dir ("" before it exists): tmp/<hex>.<source>/fs.
func partialLayer(dir, diffHex string) string {
	m, _ := filepath.Glob(filepath.Join(dir, "tmp", diffHex+".*", "fs"))
	if len(m) == 0 {
		return ""
	}
	return m[0]
}

// imageAgent starts an agent whose driver trusts the registry's CA and
// keeps unused images for gc.
func imageAgent(t *testing.T, reg *TestRegistry, gc string) *Agent {
	t.Helper()
	return StartAgent(t, AgentOptions{Drivers: []string{DriverName}, DriverConfig: fmt.Sprintf(
		"    registry_ca_file = %q\n    image_gc = %q", reg.CAFile, gc)})
}

// imageJob runs the image job and returns it.
func imageJob(t *testing.T, a *Agent, ref, user, password string, count int) Job {
	t.Helper()
	return a.RunJob(t, "image", map[string]string{"Image": ref, "Username": user, "Password": password,
		"Count": fmt.Sprint(count), "Timeout": "2m"})
}

// allocEvents waits until every allocation of the job has an event that
// contains one of want, and returns the events' text of each.
func allocEvents(t *testing.T, a *Agent, jobID string, count int, want ...string) []string {
	t.Helper()
	var texts []string
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		allocs, err := a.JobAllocations(jobID)
		if err != nil || len(allocs) != count {
			return false
		}
		texts = texts[:0]
		for _, s := range allocs {
			al, err := a.allocation(s.ID)
			if err != nil {
				return false
			}
			text := eventsText(al, "")
			if !slices.ContainsFunc(want, func(w string) bool { return strings.Contains(text, w) }) {
				return false
			}
			texts = append(texts, text)
		}
		return true
	}), wait.Timeout(2*time.Minute), wait.Gap(250*time.Millisecond)), must.Sprintf("no event with one of %q", want))
	return texts
}

func TestImageTaskPullErrorsAndEvents(t *testing.T) {
	reg, img, ref := registryWithFixture(t)
	a := imageAgent(t, reg, "24h")

	t.Run("two tasks, one pull", func(t *testing.T) {
		reg.SetBlobDelay(time.Millisecond)
		defer reg.SetBlobDelay(0)
		reg.ResetRequests()
		job := imageJob(t, a, ref, reg.Username, reg.Password, 2)
		texts := allocEvents(t, a, job.ID, 2, "Pulled image "+ref, "Image "+ref+" is present")
		pulled := 0
		for _, text := range texts {
			if strings.Contains(text, "Pulled image "+ref) {
				pulled++
				must.StrContains(t, text, "Downloading image "+ref)
			}
			must.StrNotContains(t, text, reg.Password)
		}
		must.Positive(t, pulled)
		must.StrNotContains(t, a.Log(), reg.Password)
		for _, b := range blobsOf(t, img) {
			must.Eq(t, 1, reg.Requests("GET", "/blobs/"+b), must.Sprintf("blob %s", b))
		}
		a.StopJob(t, job.ID)
	})

	t.Run("a tag pushed again, force_pull", func(t *testing.T) {
		// A tag other than latest that the node has is not asked of the
		// registry again, as Nomad's docker driver; force_pull asks.
		moving, err := reg.Push("csi/fixture:moving", img)
		must.NoError(t, err)
		first, err := img.Digest()
		must.NoError(t, err)
		run := func(force bool, want ...string) {
			t.Helper()
			vars := map[string]string{"Image": moving, "Username": reg.Username, "Password": reg.Password, "Count": "1", "Timeout": "2m"}
			if force {
				vars["ForcePull"] = "1"
			}
			job := a.RunJob(t, "image", vars)
			allocEvents(t, a, job.ID, 1, want...)
			a.StopJob(t, job.ID)
		}
		// The fixture's image under a new tag: present when an earlier
		// case pulled the fixture.
		run(false, "Image "+moving+" is present ("+first.String()[:19], "Pulled image "+moving+" ("+first.String()[:19])
		_, second, _ := pushOnFixtureBase(t, reg, "csi/fixture:moving", imagebuild.File("moved", []byte("2"), 0o644))
		next, err := second.Digest()
		must.NoError(t, err)
		reg.ResetRequests()
		run(false, "Image "+moving+" is present ("+first.String()[:19])
		must.Eq(t, 0, reg.Requests("GET", "/manifests/"))
		must.Eq(t, 0, reg.Requests("HEAD", "/manifests/"))
		run(true, "Pulled image "+moving+" ("+next.String()[:19])
		must.Positive(t, reg.Requests("GET", "/manifests/")+reg.Requests("HEAD", "/manifests/"))
		run(false, "Image "+moving+" is present ("+next.String()[:19])
	})

	for _, tc := range []struct {
		name, ref, user, password, want string
	}{
		{"wrong credentials", ref, reg.Username, "not-" + reg.Password, "refused the credentials"},
		{"unknown tag", reg.Host + "/csi/fixture:0.0", reg.Username, reg.Password, "not found"},
		{"local file outside local_image_dirs", "oci-archive:/etc/shadow", "", "", "local_image_dirs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			job := imageJob(t, a, tc.ref, tc.user, tc.password, 1)
			al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed)
			all := eventsText(al, "")
			t.Logf("events:\n%s", all)
			must.StrContains(t, all, tc.want)
			must.StrContains(t, all, tc.ref)
			if tc.password != "" {
				must.StrNotContains(t, all, tc.password)
				must.StrNotContains(t, a.Log(), tc.password)
			}
		})
	}
	t.Run("crafted layers", func(t *testing.T) {
		// Layers that try to write on the host, through the registry and
		// the driver: each is refused, the host is as it was.
		hostDir := t.TempDir()
		victim := filepath.Join(hostDir, "victim")
		must.NoError(t, os.WriteFile(victim, []byte("host"), 0o644))
		for name, entries := range map[string][]imagebuild.Entry{
			"dotdot":            {imagebuild.File("../../../../../../.."+victim, []byte("pwned"), 0o644)},
			"symlink then file": {imagebuild.Symlink("evil", hostDir), imagebuild.File("evil/victim", []byte("pwned"), 0o644)},
			"hardlink to host":  {imagebuild.Hardlink("h", victim), imagebuild.File("h", []byte("pwned"), 0o644)},
		} {
			layer, err := imagebuild.Layer(entries...)
			must.NoError(t, err)
			crafted, err := imagebuild.Build(imagebuild.Spec{}, layer)
			must.NoError(t, err)
			cref, err := reg.Push("evil/"+strings.ReplaceAll(name, " ", "-")+":1", crafted)
			must.NoError(t, err)
			job := imageJob(t, a, cref, reg.Username, reg.Password, 1)
			al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed)
			must.StrContains(t, eventsText(al, ""), "is refused: unsafe layer", must.Sprint(name))
			b, err := os.ReadFile(victim)
			must.NoError(t, err)
			must.Eq(t, "host", string(b), must.Sprint(name))
			entries, err := os.ReadDir(hostDir)
			must.NoError(t, err)
			must.SliceLen(t, 1, entries, must.Sprint(name))
		}
	})

	t.Run("image_pull_timeout", func(t *testing.T) {
		// An image the store lacks, whose blobs crawl through the proxy:
		// 3 s are not enough.
		big, err := imagebuild.Layer(imagebuild.File("big", randomBytes(t, 4<<20), 0o644))
		must.NoError(t, err)
		slowImg, err := imagebuild.Build(imagebuild.Spec{}, big)
		must.NoError(t, err)
		slow, err := reg.Push("csi/slow:1", slowImg)
		must.NoError(t, err)
		reg.SetBlobDelay(200 * time.Millisecond)
		defer reg.SetBlobDelay(0)
		job := a.RunJob(t, "image", map[string]string{"Image": slow, "Username": reg.Username, "Password": reg.Password,
			"Count": "1", "Timeout": "3s"})
		start := time.Now()
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed)
		all := eventsText(al, "")
		must.StrContains(t, all, "did not finish within image_pull_timeout")
		must.StrContains(t, all, slow)
		must.Less(t, time.Minute, time.Since(start))
		must.MapNotContainsKey(t, storeState(t, a.DriverRoot), "tmp")
	})
	t.Run("registry down", func(t *testing.T) {
		// A tag this node never pulled (so no image of the store can
		// stand in for it), from a registry that stopped: the driver
		// says it retries, then fails saying the registry is unreachable.
		down, err := reg.Push("csi/fixture:down", img)
		must.NoError(t, err)
		reg.Stop()
		defer func() { must.NoError(t, reg.Start()) }()
		job := imageJob(t, a, down, reg.Username, reg.Password, 1)
		al := a.WaitAlloc(t, job.ID, 2*time.Minute, StatusFailed)
		all := eventsText(al, "")
		t.Logf("events:\n%s", all)
		must.StrContains(t, all, "retrying in")
		must.StrContains(t, all, "(attempt 5 of 5)")
		must.StrContains(t, all, "unreachable")
		must.StrContains(t, all, down)
	})

	// No lease outlives its task.
	must.MapNotContainsKey(t, storeState(t, a.DriverRoot), "uses")
}

// runningTaskID reads the driver's task ID of the allocation's task from
// its state under root_dir (tasks/*/invocation.json).
func runningTaskID(t *testing.T, a *Agent, allocID string) string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(a.DriverRoot, "tasks", "*", "invocation.json"))
	must.NoError(t, err)
	for _, f := range files {
		b, err := os.ReadFile(f)
		must.NoError(t, err)
		var iv struct {
			TaskID  string `json:"task_id"`
			AllocID string `json:"alloc_id"`
		}
		must.NoError(t, json.Unmarshal(b, &iv))
		if iv.AllocID == allocID {
			return iv.TaskID
		}
	}
	t.Fatalf("no task state of allocation %s under %s", allocID, a.DriverRoot)
	return ""
}

// The driver's GC loop removes the images no task uses once image_gc has
// passed, and their layers no other image has; an image a task that still
// exists uses stays, and goes once the task is gone.
func TestImageGC(t *testing.T) {
	reg := StartRegistry(t)
	build := func(name string) (string, v1.Image) {
		ref, img, _ := pushOnFixtureBase(t, reg, "gc/"+name+":1", imagebuild.File(name, randomBytes(t, 64<<10), 0o644))
		return ref, img
	}
	usedRef, used := build("used")
	unusedRef, unused := build("unused")
	a := imageAgent(t, reg, "3s")
	good := reg.DockerConfig(t, reg.Password)
	for _, ref := range []string{usedRef, unusedRef} {
		_, errOut, err := driverCLI(t, "", "images", "pull", "-root-dir", a.DriverRoot, "-auth-config", good, ref)
		must.NoError(t, err, must.Sprint(errOut))
	}
	must.SliceLen(t, 2, listImages(t, a.DriverRoot))

	// A task of this driver takes a lease on "used", as StartTask does
	// for a task's image (the store is shared with other processes).
	job := a.RunJob(t, "sleep", map[string]string{"Driver": DriverName, "Count": "1"})
	al := a.WaitAlloc(t, job.ID, time.Minute, StatusRunning)
	taskID := runningTaskID(t, a, al.ID)
	s, err := image.Open(a.DriverRoot, image.Options{})
	must.NoError(t, err)
	usedDigest, err := used.Digest()
	must.NoError(t, err)
	must.NoError(t, s.Acquire(t.Context(), image.Use{TaskID: taskID, AllocID: al.ID, TaskName: "t"}, usedDigest.String()))

	unusedDigest, err := unused.Digest()
	must.NoError(t, err)
	digests := func() []string {
		var out []string
		for _, i := range listImages(t, a.DriverRoot) {
			out = append(out, i.Digest)
		}
		return out
	}
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		return !slices.Contains(digests(), unusedDigest.String())
	}), wait.Timeout(time.Minute), wait.Gap(500*time.Millisecond)), must.Sprint("the unused image stayed"))
	// Several GC rounds later the used image and the shared base stay.
	time.Sleep(5 * time.Second)
	list := listImages(t, a.DriverRoot)
	must.SliceLen(t, 1, list)
	must.Eq(t, usedDigest.String(), list[0].Digest)
	must.SliceLen(t, 1, list[0].InUseBy)
	st := storeState(t, a.DriverRoot)
	must.SliceLen(t, 2, st["layers"])
	ul, err := unused.Layers()
	must.NoError(t, err)
	gone, err := ul[1].DiffID()
	must.NoError(t, err)
	must.SliceNotContains(t, st["layers"], gone.Hex)

	// The task goes: its lease no longer holds, and the image follows.
	a.StopJob(t, job.ID)
	// GC removes the record first, then the layers: wait for both.
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		st := storeState(t, a.DriverRoot)
		return len(listImages(t, a.DriverRoot)) == 0 && len(st["layers"]) == 0
	}), wait.Timeout(time.Minute), wait.Gap(500*time.Millisecond)), must.Sprint("the image of the stopped task stayed"))
	st = storeState(t, a.DriverRoot)
	must.SliceEmpty(t, st["uses"])
	must.SliceEmpty(t, st["configs"])
}

// A driver killed in the middle of a layer leaves nothing a later start
// uses; started again, it pulls the layer whole for the task.
func TestImageDriverKilledMidPull(t *testing.T) {
	reg := StartRegistry(t)
	ref, img, big := pushOnFixtureBase(t, reg, "csi/big:1", imagebuild.File("big", randomBytes(t, 8<<20), 0o644))
	diff, err := big.DiffID()
	must.NoError(t, err)
	a := imageAgent(t, reg, "24h")
	partial := func() string { return partialLayer(image.Dir(a.DriverRoot), diff.Hex) }

	reg.SetBlobDelay(20 * time.Millisecond)
	first := imageJob(t, a, ref, reg.Username, reg.Password, 1)
	must.Wait(t, wait.InitialSuccess(wait.BoolFunc(func() bool {
		entries, err := os.ReadDir(partial())
		return err == nil && len(entries) > 0
	}), wait.Timeout(time.Minute), wait.Gap(20*time.Millisecond)), must.Sprint("the layer was never being unpacked"))
	old := a.KillDriver(t)
	reg.SetBlobDelay(0)
	a.WaitDriverBack(t, old, time.Minute)

	// Nomad starts the task again on the new driver process (a plugin
	// that died is a recoverable error): that start pulls the layer anew,
	// whole, and verifies it; nothing of the killed pull is used.
	allocEvents(t, a, first.ID, 1, "Pulled image "+ref)
	bd, err := big.Digest()
	must.NoError(t, err)
	must.Eq(t, 2, reg.Requests("GET", "/blobs/"+bd.String()))
	list := listImages(t, a.DriverRoot)
	must.SliceLen(t, 1, list)
	d, err := img.Digest()
	must.NoError(t, err)
	must.Eq(t, d.String(), list[0].Digest)
	must.MapNotContainsKey(t, storeState(t, a.DriverRoot), "tmp")
	fi, err := os.Stat(filepath.Join(image.Dir(a.DriverRoot), "layers", diff.Hex, "fs", "big"))
	must.NoError(t, err)
	must.Eq(t, int64(8<<20), fi.Size())
}
