package supervisor

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"testing"
	"time"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// BenchmarkTaskRoot breaks down what building a task's root costs a
// supervisor, step by step, isolated (DefaultChrootEnv, private PID and
// IPC) against privileged (the host's view), in the same iteration. Each
// build runs on a fresh thread whose mount (and IPC) namespace it
// unshares, as launchTask's does; the thread ends with the build, and its
// namespace with it, so nothing is left on the host. The steps are timed
// one by one and reported as medians, in milliseconds:
//
//   - unshare: unshare(2) of the namespaces and prepareNamespace's
//     propagation pass over the mount table;
//   - root: the tmpfs root (isolated) or the tmpfs with every entry of
//     the host's / bound in (privileged, buildRoot);
//   - chroot_env, dev, proc, sys: buildIsolatedRoot's steps;
//   - dirs: Nomad's four directories (/alloc, /local, /secrets, /tmp) as
//     a task gets them: cloned before pivot_root and attached after it
//     (isolated), bound before it (privileged);
//   - pivot: pivot_root into the root and the seal (read-only /);
//   - isolated-ms and privileged-ms are the sums, ratio their quotient.
//
// A spare supervisor does unshare, root, chroot_env, dev, proc, sys and
// pivot ahead of its task, but only a task without mounts (spec.Mounts)
// can take that root: a task of Nomad has its directories.
//
//	go test -run '^$' -bench TaskRoot -benchtime 50x ./driver/executor/supervisor/
//
// It needs root. /proc is mounted here for the benchmark's own PID
// namespace, the host's, not for a new one as a supervisor's is.
func BenchmarkTaskRoot(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: builds task roots in mount namespaces")
	}
	base := b.TempDir()
	src := filepath.Join(base, "alloc")
	var dirs []wire.Mount
	for _, d := range [][2]string{{"alloc", "/alloc"}, {"local", "/local"}, {"secrets", "/secrets"}, {"tmp", "/tmp"}} {
		p := filepath.Join(src, d[0])
		must.NoError(b, os.MkdirAll(p, 0o755))
		dirs = append(dirs, wire.Mount{Source: p, Target: d[1], Propagation: wire.PropagationPrivate})
	}
	iso := &wire.Isolation{ChrootEnv: wire.DefaultChrootEnv, PrivatePID: true, PrivateIPC: true}
	steps := stepTimes{}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, isolated := range []bool{i%2 == 0, i%2 != 0} {
			root := filepath.Join(base, "root", string(rune('a'+j)))
			must.NoError(b, os.MkdirAll(root, 0o755))
			var times map[string]time.Duration
			var err error
			onOwnThread(func() {
				if isolated {
					times, err = timeIsolatedRoot(root, iso, dirs)
				} else {
					times, err = timePrivilegedRoot(root, dirs)
				}
			})
			must.NoError(b, err)
			// The root's directory stays empty on the host: its tmpfs was
			// in the thread's namespace only.
			must.NoError(b, os.Remove(root))
			if isolated {
				steps.add("isolated-", times)
			} else {
				steps.add("privileged-", times)
			}
		}
	}
	b.StopTimer()
	steps.report(b)
	b.ReportMetric(float64(medianOf(steps["isolated-total"]))/float64(medianOf(steps["privileged-total"])), "ratio")
}

// stepTimes are the times of a benchmark's steps, by name.
type stepTimes map[string][]time.Duration

// add adds one build's times of its steps, under prefix, and their sum
// as prefix+"total".
func (s stepTimes) add(prefix string, times map[string]time.Duration) {
	total := time.Duration(0)
	for k, d := range times {
		s[prefix+k] = append(s[prefix+k], d)
		total += d
	}
	s[prefix+"total"] = append(s[prefix+"total"], total)
}

// report reports each step's median, in milliseconds.
func (s stepTimes) report(b *testing.B) {
	names := make([]string, 0, len(s))
	for k := range s {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		b.ReportMetric(float64(medianOf(s[k]).Microseconds())/1000, k+"-ms")
	}
}

// onOwnThread runs f on a thread of its own, which ends with it (and the
// namespaces f unshared with the thread).
func onOwnThread(f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		// Never unlocked: the thread ends with the goroutine.
		runtime.LockOSThread()
		f()
	}()
	<-done
}

// timeIsolatedRoot builds an isolated task's root at root as
// launchOnThread does, on the calling (locked) thread, timing each step.
func timeIsolatedRoot(root string, iso *wire.Isolation, dirs []wire.Mount) (map[string]time.Duration, error) {
	m := mounter.New()
	var trees []*os.File
	defer func() {
		for _, tr := range trees {
			_ = tr.Close()
		}
	}()
	return timeSteps([]benchStep{
		{"unshare", func() error {
			if err := unix.Unshare(namespaceFlags(iso)); err != nil {
				return err
			}
			return prepareNamespace(m, nil, "", iso, nil)
		}},
		{"root", func() error {
			if err := os.MkdirAll(root, 0o755); err != nil {
				return err
			}
			if err := m.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
				return err
			}
			return m.SetPropagation(root, mounter.PropagationUnbindable, false)
		}},
		{"chroot_env", func() error { return bindChrootEnv(m, root, iso.ChrootEnv) }},
		{"dev", func() error { return buildDev(m, root, iso.PrivateIPC) }},
		{"proc", func() error { return buildProc(m, root, iso.PrivatePID) }},
		{"sys", func() error { return buildSys(m, root) }},
		{"dirs", func() error {
			for _, mnt := range dirs {
				tr, err := m.CloneTree(mnt.Source, true)
				if err != nil {
					return err
				}
				trees = append(trees, tr)
			}
			return nil
		}},
		{"pivot", func() error { return pivotRoot(root) }},
		{"dirs", func() error { return attachAll(m, trees, dirs, "/", true) }},
		{"pivot", func() error { return sealRoot(m) }},
	})
}

// timePrivilegedRoot builds a privileged task's root at root as
// launchOnThread does, on the calling (locked) thread, timing each step.
func timePrivilegedRoot(root string, dirs []wire.Mount) (map[string]time.Duration, error) {
	m := mounter.New()
	return timeSteps([]benchStep{
		{"unshare", func() error {
			if err := unix.Unshare(namespaceFlags(nil)); err != nil {
				return err
			}
			return prepareNamespace(m, nil, "", nil, nil)
		}},
		{"root", func() error { return buildRoot(m, root) }},
		{"dirs", func() error { return bindAll(m, dirs, root) }},
		{"pivot", func() error { return enterSealed(m, root) }},
	})
}

// benchStep is one timed step of a root's build.
type benchStep struct {
	name string
	f    func() error
}

// timeSteps runs steps in order, timing each (steps of one name add up),
// until one fails.
func timeSteps(steps []benchStep) (map[string]time.Duration, error) {
	t := map[string]time.Duration{}
	for _, s := range steps {
		start := time.Now()
		err := s.f()
		t[s.name] += time.Since(start)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return t, nil
}

// enterSealed is pivot_root into root and the seal.
func enterSealed(m mounter.Interface, root string) error {
	if err := pivotRoot(root); err != nil {
		return err
	}
	return sealRoot(m)
}

func medianOf(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// BenchmarkImageRoot breaks down what a privileged plugin task's root
// costs a supervisor when it is an image (an overlay of three layers, the
// host's /dev, /sys and /proc and /lib/modules bound in) against the
// host's root (buildRoot), with the mounts a plugin task of Nomad gets in
// both: Nomad's four directories, the plugin's socket directory, the
// host's resolv.conf and hosts, and the staging directory with
// bidirectional propagation at its own path. The image is built twice:
// as it is, and with the layer of its mounts' targets below it that the
// driver adds (image.Store.MountLayer), made here the same way. The three
// roots take turns. Steps, medians in milliseconds:
//
//   - unshare: unshare(2) and prepareNamespace's propagation pass;
//   - root: the overlay and the host's kernel directories (image), or the
//     tmpfs with every entry of the host's / bound in (host);
//   - mounts: the task's mounts (bindAll, through imageTargets for the
//     image);
//   - pivot: pivot_root and the seal;
//
// and the ratios of the image's totals, without and with the layer, to
// the host's.
//
//	go test -run '^$' -bench ImageRoot -benchtime 50x ./driver/executor/supervisor/
//
// It needs root (mount namespaces, overlayfs).
func BenchmarkImageRoot(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: builds task roots in mount namespaces")
	}
	base := b.TempDir()
	layers := benchImageLayers(b, filepath.Join(base, "layers"))
	// The staging directory as the driver has it: a path several
	// directories deep, below a directory the image has (/var/lib).
	stageRoot, err := os.MkdirTemp("/var/lib", "ncsi-bench-")
	must.NoError(b, err)
	b.Cleanup(func() { _ = os.RemoveAll(stageRoot) })
	staging := filepath.Join(stageRoot, "mnt")
	must.NoError(b, os.Mkdir(staging, 0o755))
	var mounts []wire.Mount
	for _, d := range [][2]string{{"alloc", "/alloc"}, {"local", "/local"}, {"secrets", "/secrets"}, {"tmp", "/tmp"}, {"csi", "/csi"}} {
		p := filepath.Join(base, "alloc", d[0])
		must.NoError(b, os.MkdirAll(p, 0o755))
		mounts = append(mounts, wire.Mount{Source: p, Target: d[1], Propagation: wire.PropagationPrivate})
	}
	for _, f := range []string{"/etc/resolv.conf", "/etc/hosts"} {
		if _, err := os.Stat(f); err == nil {
			mounts = append(mounts, wire.Mount{Source: f, Target: f, ReadOnly: true, Propagation: wire.PropagationPrivate})
		}
	}
	mounts = append(mounts, wire.Mount{Source: staging, Target: staging, Propagation: wire.PropagationBidirectional})
	points := filepath.Join(base, "mountpoints")
	for _, mnt := range mounts {
		fi, err := os.Stat(mnt.Source)
		must.NoError(b, err)
		p := filepath.Join(points, mnt.Target)
		if fi.IsDir() {
			must.NoError(b, os.MkdirAll(p, 0o755))
			continue
		}
		must.NoError(b, os.MkdirAll(filepath.Dir(p), 0o755))
		must.NoError(b, os.WriteFile(p, nil, 0o644))
	}
	kinds := map[string]*wire.ImageRoot{
		"host-":  nil,
		"image-": {Layers: layers, Ref: "bench/plugin:1"},
		"layer-": {Layers: append([]string{points}, layers...), Ref: "bench/plugin:1"},
	}
	order := []string{"host-", "image-", "layer-"}

	steps := stepTimes{}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range order {
			kind := order[(i+j)%len(order)]
			state := filepath.Join(base, "state", fmt.Sprint(i, kind))
			root := filepath.Join(state, "root")
			must.NoError(b, os.MkdirAll(root, 0o755))
			spec := &wire.Spec{Mounts: mounts, StateDir: state}
			var times map[string]time.Duration
			var err error
			onOwnThread(func() { times, err = timePluginRoot(spec, root, kinds[kind]) })
			must.NoError(b, err)
			steps.add(kind, times)
			// What the task wrote stays in its state directory, as a
			// task's writable layer does; a new one each time.
			b.StopTimer()
			must.NoError(b, os.RemoveAll(state))
			b.StartTimer()
		}
	}
	b.StopTimer()
	steps.report(b)
	host := float64(medianOf(steps["host-total"]))
	b.ReportMetric(float64(medianOf(steps["image-total"]))/host, "image/host")
	b.ReportMetric(float64(medianOf(steps["layer-total"]))/host, "layer/host")
}

// benchImageLayers makes three layer directories of a small distribution's
// shape under dir: a merged /usr (/lib a symlink to usr/lib), /var/run a
// symlink to /run, and /etc with resolv.conf and hosts of its own.
func benchImageLayers(b *testing.B, dir string) []string {
	b.Helper()
	files := [][]string{
		{"usr/lib/x86_64-linux-gnu/libc.so.6", "usr/bin/sh", "etc/passwd", "etc/group", "etc/resolv.conf", "etc/hosts", "var/lib/dpkg/status", "run/.keep", "tmp/.keep"},
		{"usr/lib/modules/.keep", "usr/sbin/mount.nfs", "etc/nfs.conf"},
		{"csi-plugin", "etc/plugin/config.yaml"},
	}
	links := [][2]string{{"usr/lib", "lib"}, {"usr/bin", "bin"}, {"/run", "var/run"}}
	var layers []string
	for i, list := range files {
		l := filepath.Join(dir, fmt.Sprint(i))
		for _, f := range list {
			must.NoError(b, os.MkdirAll(filepath.Join(l, filepath.Dir(f)), 0o755))
			must.NoError(b, os.WriteFile(filepath.Join(l, f), []byte(f), 0o644))
		}
		if i == 0 {
			for _, s := range links {
				must.NoError(b, os.Symlink(s[0], filepath.Join(l, s[1])))
			}
		}
		// The base first, as wire.ImageRoot lists them.
		layers = append(layers, l)
	}
	return layers
}

// timePluginRoot builds a privileged task's root at root as
// launchOnThread and forkTask do, on the calling (locked) thread: of the
// image img, or of the host's paths when img is nil.
func timePluginRoot(spec *wire.Spec, root string, img *wire.ImageRoot) (map[string]time.Duration, error) {
	var m mounter.Interface = mounter.New()
	if img != nil {
		m = newImageTargets(m, root, spec)
	}
	return timeSteps([]benchStep{
		{"unshare", func() error {
			if err := unix.Unshare(namespaceFlags(nil)); err != nil {
				return err
			}
			return prepareNamespace(m, spec.Mounts, "", nil, nil)
		}},
		{"root", func() error { return enterNewRoot(m, root, nil, img) }},
		{"mounts", func() error { return bindAll(m, spec.Mounts, root) }},
		{"pivot", func() error { return enterSealed(m, root) }},
	})
}
