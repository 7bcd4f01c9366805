package driver

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
)

// testLayers makes layer directories from maps of path to content, lowest
// first: "->target" makes a symlink, "<whiteout>" overlay's whiteout (which
// needs root), "<opaque>" an opaque directory, a trailing "/" a directory.
func testLayers(t *testing.T, layers ...map[string]string) []string {
	t.Helper()
	var out []string
	for i, files := range layers {
		dir := filepath.Join(t.TempDir(), "layer", string(rune('a'+i)))
		must.NoError(t, os.MkdirAll(dir, 0o755))
		for p, content := range files {
			full := filepath.Join(dir, p)
			must.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
			switch {
			case strings.HasPrefix(content, "->"):
				must.NoError(t, os.Symlink(strings.TrimPrefix(content, "->"), full))
			case content == "<whiteout>":
				if os.Geteuid() != 0 {
					t.Skip("a whiteout is a device node: test needs root")
				}
				must.NoError(t, unix.Mknod(full, unix.S_IFCHR, 0))
			case content == "<opaque>":
				if os.Geteuid() != 0 {
					t.Skip("an opaque directory has a trusted xattr: test needs root")
				}
				must.NoError(t, os.MkdirAll(full, 0o755))
				must.NoError(t, unix.Setxattr(full, "trusted.overlay.opaque", []byte("y"), 0))
			case strings.HasSuffix(p, "/"):
				must.NoError(t, os.MkdirAll(full, 0o755))
			default:
				must.NoError(t, os.WriteFile(full, []byte(content), 0o644))
			}
		}
		out = append(out, dir)
	}
	return out
}

func TestLayeredFS_Lookup(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "host-secret")
	must.NoError(t, os.WriteFile(outside, []byte("host"), 0o644))
	layers := testLayers(t,
		map[string]string{
			"etc/passwd":    "base",
			"etc/group":     "base-group",
			"usr/lib/x":     "usr-x",
			"lib":           "->usr/lib",
			"abs":           "->/usr/lib/x",
			"up":            "->../../../../../../" + strings.TrimPrefix(outside, "/"),
			"hostabs":       "->" + outside,
			"loop":          "->loop",
			"dir/old":       "old",
			"file-then-dir": "f",
		},
		map[string]string{
			"etc/passwd":      "top",
			"dir/new":         "new",
			"file-then-dir/":  "",
			"file-then-dir/x": "x",
		},
	)
	fs := newLayeredFS(layers)
	read := func(p string) string {
		b, err := fs.readFile(p, 1024)
		if err != nil {
			return "error: " + err.Error()
		}
		return string(b)
	}
	must.Eq(t, "top", read("/etc/passwd"))
	must.Eq(t, "base-group", read("/etc/group"))
	must.Eq(t, "usr-x", read("/lib/x"), must.Sprint("a relative symlink of the image"))
	must.Eq(t, "usr-x", read("/abs"), must.Sprint("an absolute symlink starts at the image's root"))
	must.Eq(t, "old", read("/dir/old"), must.Sprint("directories of two layers merge"))
	must.Eq(t, "new", read("/dir/new"))
	must.Eq(t, "x", read("/file-then-dir/x"))
	_, err := fs.readFile("/up", 1024)
	must.ErrorIs(t, err, os.ErrNotExist, must.Sprint(".. never leaves the image's root"))
	_, err = fs.readFile("/hostabs", 1024)
	must.ErrorIs(t, err, os.ErrNotExist, must.Sprint("an absolute symlink to a host path stays in the image"))
	must.StrContains(t, read("/loop"), "too many levels")
	must.StrContains(t, read("/etc"), "not a regular file")
	_, err = fs.readFile("/etc/passwd", 2)
	must.ErrorContains(t, err, "larger than 2 bytes")
}

func TestLayeredFS_Whiteouts_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("whiteouts and opaque directories need root to make")
	}
	layers := testLayers(t,
		map[string]string{"etc/passwd": "base", "opq/old": "old", "gone/x": "x"},
		map[string]string{"etc/passwd": "<whiteout>", "opq": "<opaque>", "opq/new": "new", "gone": "<whiteout>"},
		map[string]string{"gone/y": "y"},
	)
	fs := newLayeredFS(layers)
	_, err := fs.readFile("/etc/passwd", 1024)
	must.ErrorIs(t, err, os.ErrNotExist)
	_, err = fs.readFile("/opq/old", 1024)
	must.ErrorIs(t, err, os.ErrNotExist, must.Sprint("an opaque directory hides the lower layer's entries"))
	b, err := fs.readFile("/opq/new", 1024)
	must.NoError(t, err)
	must.Eq(t, "new", string(b))
	_, err = fs.readFile("/gone/x", 1024)
	must.ErrorIs(t, err, os.ErrNotExist, must.Sprint("a directory made again above a whiteout shows nothing of the one below"))
	b, err = fs.readFile("/gone/y", 1024)
	must.NoError(t, err)
	must.Eq(t, "y", string(b))
}

func TestResolveImageUser(t *testing.T) {
	layers := testLayers(t, map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\n# comment\nbroken line\ncsi:x:1000:1001::/home/csi:/bin/sh\nnohome:x:1002:1002::\n",
		"etc/group":  "root:x:0:\ncsi:x:1001:\ndisk:x:6:csi\nvideo:x:44:other,csi\nstaff:x:50:\n",
	})
	fs := newLayeredFS(layers)
	cases := []struct {
		user string
		want executor.Credential
		home string
		err  string
	}{
		{"csi", executor.Credential{UID: 1000, GID: 1001, Groups: []uint32{6, 44}}, "/home/csi", ""},
		{"1000", executor.Credential{UID: 1000, GID: 1001, Groups: []uint32{6, 44}}, "/home/csi", ""},
		{"root", executor.Credential{UID: 0, GID: 0}, "/root", ""},
		// With a group, only that group: the image's /etc/group gives no
		// supplementary groups (Docker's USER, the OCI image spec's User).
		{"csi:staff", executor.Credential{UID: 1000, GID: 50}, "/home/csi", ""},
		{"csi:7", executor.Credential{UID: 1000, GID: 7}, "/home/csi", ""},
		{"1000:1001", executor.Credential{UID: 1000, GID: 1001}, "/home/csi", ""},
		{"4242", executor.Credential{UID: 4242, GID: 4242}, "/", ""},
		{"4242:5", executor.Credential{UID: 4242, GID: 5}, "/", ""},
		{"nohome", executor.Credential{UID: 1002, GID: 1002}, "/", ""},
		{"nobody", executor.Credential{}, "", `user "nobody" is not in the image's /etc/passwd`},
		{"csi:wheel", executor.Credential{}, "", `group "wheel" of user "csi:wheel" is not in the image's /etc/group`},
		{":5", executor.Credential{}, "", "must be a name or uid"},
	}
	for _, tc := range cases {
		t.Run(tc.user, func(t *testing.T) {
			u, err := resolveImageUser(fs, tc.user)
			if tc.err != "" {
				must.ErrorContains(t, err, tc.err)
				return
			}
			must.NoError(t, err)
			must.Eq(t, tc.want, u.cred)
			must.Eq(t, tc.home, u.home)
		})
	}
	// An image without /etc/passwd knows only numeric ids.
	empty := newLayeredFS(testLayers(t, map[string]string{"bin/x": ""}))
	u, err := resolveImageUser(empty, "65534")
	must.NoError(t, err)
	must.Eq(t, executor.Credential{UID: 65534, GID: 65534}, u.cred)
	_, err = resolveImageUser(empty, "csi")
	must.ErrorContains(t, err, "not in the image's /etc/passwd")
}

// The table in imageCommand's comment, case by case.
func TestImageCommand(t *testing.T) {
	img := &image.Image{Ref: "example/csi:1", Config: image.Config{Entrypoint: []string{"/entry", "-v"}, Cmd: []string{"serve", "--x"}}}
	cases := []struct {
		name string
		tc   TaskConfig
		want []string
	}{
		{"image's", TaskConfig{}, []string{"/entry", "-v", "serve", "--x"}},
		{"args", TaskConfig{Args: []string{"a", "b"}}, []string{"/entry", "-v", "a", "b"}},
		{"command", TaskConfig{Command: "run"}, []string{"/entry", "-v", "run"}},
		{"command and args", TaskConfig{Command: "run", Args: []string{"a"}}, []string{"/entry", "-v", "run", "a"}},
		{"entrypoint", TaskConfig{Entrypoint: []string{"/bin/sh"}}, []string{"/bin/sh"}},
		{"entrypoint and args", TaskConfig{Entrypoint: []string{"/bin/sh"}, Args: []string{"-c", "x"}}, []string{"/bin/sh", "-c", "x"}},
		{"everything", TaskConfig{Entrypoint: []string{"/bin/sh"}, Command: "-c", Args: []string{"x"}}, []string{"/bin/sh", "-c", "x"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := imageCommand(img, &tc.tc)
			must.NoError(t, err)
			must.Eq(t, tc.want, got)
		})
	}
	// An image with only a Cmd runs it; one with neither needs a command.
	got, err := imageCommand(&image.Image{Config: image.Config{Cmd: []string{"/plugin", "--endpoint=x"}}}, &TaskConfig{})
	must.NoError(t, err)
	must.Eq(t, []string{"/plugin", "--endpoint=x"}, got)
	_, err = imageCommand(&image.Image{Ref: "empty:1"}, &TaskConfig{})
	must.ErrorContains(t, err, `image "empty:1" has no entrypoint or cmd to run: set command`)
}

func TestImageEnv(t *testing.T) {
	got := imageEnv([]string{"PATH=/img/bin", "LANG=C", "CSI_ENDPOINT=unix:///img.sock", "bad", "=x"},
		[]string{"CSI_ENDPOINT=unix:///csi/csi.sock", "NOMAD_TASK_NAME=t"})
	must.Eq(t, []string{"PATH=/img/bin", "LANG=C", "CSI_ENDPOINT=unix:///csi/csi.sock", "NOMAD_TASK_NAME=t"}, got)

	// The PATH buildSpec adds when Nomad gives none yields to the image's.
	cfg := &drivers.TaskConfig{Env: map[string]string{"A": "1"}}
	must.Eq(t, []string{"A=1"}, nomadEnv(cfg, []string{"A=1", "PATH=" + defaultTaskPath}))
	cfg.Env["PATH"] = defaultTaskPath
	must.Eq(t, []string{"A=1", "PATH=" + defaultTaskPath}, nomadEnv(cfg, []string{"A=1", "PATH=" + defaultTaskPath}))
}

func TestTaskConfig_ValidateCommand(t *testing.T) {
	cases := []struct {
		tc  TaskConfig
		err string
	}{
		{TaskConfig{Command: "/bin/sh"}, ""},
		{TaskConfig{}, "command must not be empty"},
		{TaskConfig{Command: "/bin/sh", Entrypoint: []string{"/x"}}, "entrypoint needs an image"},
		{TaskConfig{Command: "/bin/sh", ReadonlyRootfs: true}, "readonly_rootfs needs an image"},
		{TaskConfig{Image: "example/csi:1"}, ""},
		{TaskConfig{Image: "example/csi:1", Command: " run"}, `command " run" has white space around it`},
		{TaskConfig{Image: "example/csi:1", Entrypoint: []string{""}}, "entrypoint's first element"},
		{TaskConfig{Image: "example/csi:1", Entrypoint: []string{"/bin/sh"}, ReadonlyRootfs: true}, ""},
	}
	for _, tc := range cases {
		err := tc.tc.validateCommand()
		if tc.err == "" {
			must.NoError(t, err)
		} else {
			must.ErrorContains(t, err, tc.err)
		}
	}
}

// applyImageRoot: the image's configuration under the task's, its user
// resolved in the image and checked against the denied ids, the layers as
// the root, and the host's resolver files read-only.
func TestApplyImageRoot(t *testing.T) {
	layers := testLayers(t, map[string]string{
		"etc/passwd": "root:x:0:0::/root:/bin/sh\ncsi:x:1000:1000::/home/csi:/bin/sh\n",
		"etc/group":  "csi:x:1000:\nshadow:x:42:csi\n",
	})
	img := &image.Image{Ref: "example/csi:1", Digest: "sha256:abc", Layers: layers, Config: image.Config{
		Entrypoint: []string{"/plugin"}, Cmd: []string{"--v=5"}, Env: []string{"PATH=/opt/bin", "MODE=img"},
		WorkingDir: "/srv", User: "csi",
	}}
	newSpec := func() *executor.Spec {
		return &executor.Spec{User: "nobody", Dir: "/", Env: []string{"MODE=task", "PATH=" + defaultTaskPath},
			Isolation: &executor.Isolation{ChrootEnv: executor.DefaultChrootEnv, PrivatePID: true}}
	}
	d := &Driver{}
	conf := &Config{}
	cfg := &drivers.TaskConfig{Env: map[string]string{"MODE": "task"}}
	spec := newSpec()
	must.NoError(t, d.applyImageRoot(conf, cfg, &TaskConfig{Image: img.Ref, ReadonlyRootfs: true}, spec, img))
	must.Eq(t, "/plugin", spec.Command)
	must.Eq(t, []string{"--v=5"}, spec.Args)
	must.Eq(t, "csi", spec.User)
	must.Eq(t, &executor.Credential{UID: 1000, GID: 1000, Groups: []uint32{42}}, spec.Credential)
	must.Eq(t, []string{"PATH=/opt/bin", "MODE=task", "HOME=/home/csi"}, spec.Env)
	must.Eq(t, "/srv", spec.Dir)
	must.Eq(t, &executor.ImageRoot{Layers: layers, ReadOnly: true, Ref: img.Ref, Digest: img.Digest}, spec.Image)
	must.MapEmpty(t, spec.Isolation.ChrootEnv)
	for _, m := range spec.Mounts {
		must.True(t, m.ReadOnly && m.NoSuid && m.NoDev, must.Sprintf("mount %+v", m))
		must.SliceContains(t, []string{hostResolvConf, hostHostsFile}, m.Target)
	}

	// The image's ids are the host's: the denied ones are refused, the
	// supplementary groups too.
	spec = newSpec()
	err := d.applyImageRoot(&Config{DeniedHostGIDs: "42"}, cfg, &TaskConfig{Image: img.Ref}, spec, img)
	must.ErrorContains(t, err, `user "csi": running with gid 42 is denied on this node (denied_host_gids = "42")`)
	spec = newSpec()
	err = d.applyImageRoot(&Config{DeniedHostUIDs: "0"}, &drivers.TaskConfig{User: "root"}, &TaskConfig{Image: img.Ref}, spec, img)
	must.ErrorContains(t, err, "running as uid 0 is denied")

	// The task's user, work_dir and command win; an image that names no
	// user leaves the driver's default, nobody, which this image lacks.
	noUser := *img
	noUser.Config.User = ""
	spec = newSpec()
	must.NoError(t, d.applyImageRoot(conf, &drivers.TaskConfig{}, &TaskConfig{Image: img.Ref, WorkDir: "/w", Command: "run"}, spec, &noUser))
	must.Eq(t, &executor.Credential{UID: 65534, GID: 65534}, spec.Credential)
	must.Eq(t, "/w", spec.Dir)
	must.Eq(t, []string{"/plugin", "run"}, append([]string{spec.Command}, spec.Args...))
	spec = newSpec()
	err = d.applyImageRoot(conf, &drivers.TaskConfig{User: "nobody"}, &TaskConfig{Image: img.Ref}, spec, img)
	must.ErrorContains(t, err, `task's user "nobody": user "nobody" is not in the image's /etc/passwd`)
	// A user the image's own USER names and its /etc/passwd lacks: the
	// error says where it came from, and that the task's user fixes it.
	ghost := *img
	ghost.Config.User = "ghost:csi"
	spec = newSpec()
	err = d.applyImageRoot(conf, &drivers.TaskConfig{}, &TaskConfig{Image: img.Ref}, spec, &ghost)
	must.ErrorContains(t, err, `image "example/csi:1": its USER "ghost:csi": user "ghost" is not in the image's /etc/passwd`)
	must.ErrorContains(t, err, `set user in the task`)

	// A privileged task runs as root: an image that names another user
	// needs the task's user = "root"; denied_host_uids is for the others.
	priv := &TaskConfig{Image: img.Ref, Privileged: true}
	spec = newSpec()
	err = d.applyImageRoot(&Config{DeniedHostUIDs: "0"}, &drivers.TaskConfig{}, priv, spec, img)
	must.ErrorContains(t, err, `a privileged task runs as root, and image "example/csi:1" runs as user "csi" (uid 1000): set user = "root"`)
	spec = newSpec()
	must.NoError(t, d.applyImageRoot(&Config{DeniedHostUIDs: "0"}, &drivers.TaskConfig{User: "root"}, priv, spec, img))
	must.Eq(t, uint32(0), spec.Credential.UID)

	// An image without /etc/passwd (a static plugin on scratch) has no
	// root by name: the error names what works there, the uid, and that
	// does.
	bare := *img
	bare.Layers = testLayers(t, map[string]string{"plugin": "ELF"})
	bare.Config.User = "1000"
	spec = newSpec()
	err = d.applyImageRoot(conf, &drivers.TaskConfig{}, priv, spec, &bare)
	must.ErrorContains(t, err, `runs as user "1000" (uid 1000): set user = "0" in the task`)
	spec = newSpec()
	err = d.applyImageRoot(conf, &drivers.TaskConfig{User: "root"}, priv, spec, &bare)
	must.ErrorContains(t, err, `user "root" is not in the image's /etc/passwd`, must.Sprint("the name the hint must not give"))
	spec = newSpec()
	must.NoError(t, d.applyImageRoot(conf, &drivers.TaskConfig{User: "0"}, priv, spec, &bare))
	must.Eq(t, &executor.Credential{}, spec.Credential)
}

// The volume checks of an image task (its volume's group, the write hint)
// go by the credential resolved in the image, never by a host lookup of a
// name the host may not have or may give other ids.
func TestSpecGroup_ImageCredential(t *testing.T) {
	spec := &executor.Spec{User: "no-such-user-on-this-host", Credential: &executor.Credential{UID: 1000, GID: 1001}}
	g, err := specGroup(spec)
	must.NoError(t, err)
	must.Eq(t, "1001", g)
	cred, err := credentialOf(spec.User, spec.Credential)
	must.NoError(t, err)
	must.Eq(t, uint32(1000), cred.UID)
	_, err = specGroup(&executor.Spec{User: "no-such-user-on-this-host"})
	must.Error(t, err)
	g, err = specGroup(&executor.Spec{Credential: &executor.Credential{}})
	must.NoError(t, err)
	must.Eq(t, "", g)
}

// A grant pins an image by digest: the platform manifest's digest the
// store resolved, or the multi-platform index it was picked from (what a
// registry shows for a tag, and what an operator copies); any other
// digest is refused, naming what the task resolved to.
func TestGrant_ImageIndexDigest(t *testing.T) {
	const manifest = "sha256:1111111111111111111111111111111111111111111111111111111111111111"
	const index = "sha256:2222222222222222222222222222222222222222222222222222222222222222"
	const other = "sha256:3333333333333333333333333333333333333333333333333333333333333333"
	s := grantSubject{Namespace: "storage", Job: "efs", ImageRef: "registry.example/efs:2", ImageDigest: manifest, ImageIndexDigest: index}
	for _, tc := range []struct {
		pin  string
		want string
	}{
		{manifest, ""},
		{index, ""},
		{other, "resolved to " + manifest + ", not " + other},
	} {
		g := PrivilegedGrant{Namespace: "storage", Job: "efs", Image: "registry.example/efs@" + tc.pin}
		got := g.mismatch(s)
		if tc.want == "" {
			must.Eq(t, "", got, must.Sprintf("pin %s", tc.pin))
		} else {
			must.StrContains(t, got, tc.want)
		}
	}
	// A single-platform reference has no index: only its manifest matches.
	s.ImageIndexDigest = ""
	g := PrivilegedGrant{Namespace: "storage", Job: "efs", Image: "registry.example/efs@" + index}
	must.StrContains(t, g.mismatch(s), "resolved to "+manifest)
}

// An image whose /etc/resolv.conf is a symlink keeps it: the driver adds
// the host's only where the image has a file or nothing.
func TestApplyImageRoot_ResolvConfSymlink(t *testing.T) {
	layers := testLayers(t, map[string]string{
		"etc/resolv.conf": "->../run/systemd/resolve/stub-resolv.conf",
		"etc/hosts":       "127.0.0.1 localhost\n",
	})
	img := &image.Image{Ref: "example/app:1", Layers: layers, Config: image.Config{Cmd: []string{"/app"}}}
	spec := &executor.Spec{Isolation: &executor.Isolation{}}
	must.NoError(t, (&Driver{}).applyImageRoot(&Config{}, &drivers.TaskConfig{}, &TaskConfig{Image: img.Ref}, spec, img))
	var targets []string
	for _, m := range spec.Mounts {
		targets = append(targets, m.Target)
	}
	must.SliceNotContains(t, targets, hostResolvConf)
	if _, err := os.Stat(hostHostsFile); err == nil {
		must.SliceContains(t, targets, hostHostsFile)
	}
	fs := newLayeredFS(layers)
	link, err := fs.isSymlink("/etc/resolv.conf")
	must.NoError(t, err)
	must.True(t, link)
	link, err = fs.isSymlink("/etc/hosts")
	must.NoError(t, err)
	must.False(t, link)
	link, err = fs.isSymlink("/nowhere/x")
	must.NoError(t, err)
	must.False(t, link)
}

// The targets of an image task's mounts that the image lacks come from
// the store's mount-point layer, put below the image's layers (the
// lowest), each of the kind of its source: Nomad's directories, a
// plugin's socket directory, the host's resolver files. Left out: a target
// the image has (its /etc/hosts, its /tmp), one through the image's
// symlink or file, one in /dev, /proc or /sys, one inside another mount,
// one the job chose (a host volume's destination), one whose source the
// driver cannot see. The same targets are the same layer; an image of
// overlay's most layers goes without one.
func TestApplyImageRoot_MountLayer(t *testing.T) {
	layers := testLayers(t, map[string]string{
		"etc/passwd": "root:x:0:0::/root:/bin/sh\n",
		"etc/hosts":  "127.0.0.1 localhost\n",
		"tmp/":       "",
		"srv-link":   "->/srv",
		"opt":        "a file",
	})
	img := &image.Image{Ref: "example/csi:1", Layers: layers, Config: image.Config{Entrypoint: []string{"/plugin"}}}
	store, err := image.Open(t.TempDir(), image.Options{})
	must.NoError(t, err)
	d := &Driver{logger: hclog.NewNullLogger(), images: store}
	src := t.TempDir()
	for _, n := range []string{"alloc", "local", "csi", "tmp", "data", "x"} {
		must.NoError(t, os.Mkdir(filepath.Join(src, n), 0o755))
	}
	newSpec := func() *executor.Spec {
		return &executor.Spec{Mounts: []executor.Mount{
			{Source: filepath.Join(src, "alloc"), Target: "/alloc"},
			{Source: filepath.Join(src, "local"), Target: "/local/"},
			{Source: filepath.Join(src, "csi"), Target: "/alloc/csi"},
			{Source: filepath.Join(src, "csi"), Target: "/csi"},
			{Source: filepath.Join(src, "tmp"), Target: "/tmp"},
			{Source: filepath.Join(src, "data"), Target: "/data"},
			{Source: filepath.Join(src, "x"), Target: "/srv-link/x"},
			{Source: filepath.Join(src, "x"), Target: "/opt/x"},
			{Source: "/dev/null", Target: "/dev/fuse"},
			{Source: filepath.Join(src, "missing"), Target: "/missing"},
		}}
	}
	cfg := &drivers.TaskConfig{User: "root", Mounts: []*drivers.MountConfig{{TaskPath: "/data", HostPath: filepath.Join(src, "data")}}}
	spec := newSpec()
	must.NoError(t, d.applyImageRoot(&Config{}, cfg, &TaskConfig{Image: img.Ref, Privileged: true}, spec, img))
	must.Len(t, len(layers)+1, spec.Image.Layers)
	must.Eq(t, layers, spec.Image.Layers[1:])
	layer := spec.Image.Layers[0]
	must.Eq(t, filepath.Join(store.Path(), "mountpoints"), filepath.Dir(layer))
	var got []string
	must.NoError(t, filepath.WalkDir(layer, func(p string, e fs.DirEntry, err error) error {
		if err == nil && p != layer {
			kind := "f "
			if e.IsDir() {
				kind = "d "
			}
			got = append(got, kind+strings.TrimPrefix(p, layer))
		}
		return err
	}))
	want := []string{"d /alloc", "d /csi", "d /local"}
	if _, err := os.Stat(hostResolvConf); err == nil {
		want = append(want, "d /etc", "f "+hostResolvConf)
	}
	slices.SortFunc(want, func(a, b string) int { return strings.Compare(a[2:], b[2:]) })
	must.Eq(t, want, got)

	again := newSpec()
	must.NoError(t, d.applyImageRoot(&Config{}, cfg, &TaskConfig{Image: img.Ref, Privileged: true}, again, img))
	must.Eq(t, spec.Image.Layers, again.Image.Layers)

	// overlay takes at most maxImageLayers lower layers: the image's own.
	full := *img
	full.Layers = nil
	for range maxImageLayers {
		full.Layers = append(full.Layers, layers[0])
	}
	spec = newSpec()
	must.NoError(t, d.applyImageRoot(&Config{}, cfg, &TaskConfig{Image: img.Ref, Privileged: true}, spec, &full))
	must.Eq(t, full.Layers, spec.Image.Layers)
}
