package driver

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/hcl"
	"github.com/hashicorp/nomad/helper/pluginutils/hclspecutils"
	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/hashicorp/nomad/plugins/drivers"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
)

// grantAll grants privilege to every job: for tests about anything else
// than the grants.
var grantAll = []PrivilegedGrant{{Namespace: "*", Job: "*"}}

const (
	digestA = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	digestB = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

func TestGrantGlob(t *testing.T) {
	cases := []struct {
		pattern, value string
		want           bool
	}{
		{"storage", "storage", true},
		{"storage", "storage2", false},
		{"storage", "Storage", false},
		{"*", "", true},
		{"*", "anything/at-all", true},
		{"ebs-*", "ebs-node", true},
		{"ebs-*", "ebs-", true},
		{"ebs-*", "xebs-node", false},
		{"*-node", "ebs-node", true},
		{"*-node", "ebs-node-2", false},
		{"e?s", "ebs", true},
		{"e?s", "es", false},
		{"a*b*c", "a-b-b-c", true},
		{"a*b*c", "a-b-b-d", false},
		{"backup/*", "backup/dispatch-1700000000-ab12", true},
		{"backup", "backup/dispatch-1700000000-ab12", false},
		{"[ab]", "a", false}, // no classes: '[' is itself
		{"[ab]", "[ab]", true},
		// Look-alikes are other names: a Cyrillic 'о', a zero-width space,
		// fullwidth letters, a trailing space, a case fold.
		{"ebs-node", "ebs-n\u043ede", false},
		{"ebs-node", "ebs-node\u200b", false},
		{"ebs-node", "\uff45bs-node", false},
		{"ebs-node", "ebs-node ", false},
		{"ebs-node", "EBS-NODE", false},
		{"ebs-*", "ebs-n\u043ede", true},    // a glob takes whatever follows
		{"ebs-?ode", "ebs-\u00f1ode", true}, // '?' is one character, not one byte
		{"", "", true},
		{"", "x", false},
	}
	for _, c := range cases {
		must.Eq(t, c.want, grantGlob(c.pattern, c.value), must.Sprintf("%q ~ %q", c.pattern, c.value))
	}
}

// Every field a grant sets must match; fields it leaves out match
// anything; the image field matches the digest the driver resolved, and
// nothing for a task without an image.
func TestPrivilegedGrant_mismatch(t *testing.T) {
	base := grantSubject{Namespace: "storage", Job: "ebs-node", PluginID: "ebs", Command: "/usr/local/bin/ebs"}
	image := base
	image.Command, image.ImageRef, image.ImageDigest = "", "registry.example/ebs:1.2", digestA
	cases := []struct {
		name  string
		grant PrivilegedGrant
		s     grantSubject
		want  string // "" matches; otherwise a part of the reason
	}{
		{"namespace and job", PrivilegedGrant{Namespace: "storage", Job: "ebs-node"}, base, ""},
		{"globs", PrivilegedGrant{Namespace: "stor*", Job: "*-node"}, base, ""},
		{"other namespace", PrivilegedGrant{Namespace: "default", Job: "ebs-node"}, base, `namespace "storage" is not "default"`},
		{"other job", PrivilegedGrant{Namespace: "storage", Job: "ebs-controller"}, base, `job "ebs-node" is not "ebs-controller"`},
		{"plugin id", PrivilegedGrant{Namespace: "*", Job: "*", PluginID: "ebs"}, base, ""},
		{"other plugin id", PrivilegedGrant{Namespace: "*", Job: "*", PluginID: "efs"}, base, `serves csi_plugin "ebs", and the grant is for plugin "efs"`},
		{"plugin id, no plugin", PrivilegedGrant{Namespace: "*", Job: "*", PluginID: "ebs"}, grantSubject{Namespace: "storage", Job: "ebs-node"}, "serves no csi_plugin"},
		{"command", PrivilegedGrant{Namespace: "*", Job: "*", Command: "/usr/local/bin/ebs"}, base, ""},
		{"other command", PrivilegedGrant{Namespace: "*", Job: "*", Command: "/usr/bin/ebs"}, base, `resolves to "/usr/local/bin/ebs", not "/usr/bin/ebs"`},
		{"command not resolved", PrivilegedGrant{Namespace: "*", Job: "*", Command: "/usr/local/bin/ebs"},
			grantSubject{Namespace: "storage", Job: "ebs-node", CommandErr: os.ErrPermission}, "the grant is for command"},
		{"image digest", PrivilegedGrant{Namespace: "*", Job: "*", Image: "registry.example/ebs@" + digestA}, image, ""},
		{"image digest, grant of another repository name", PrivilegedGrant{Namespace: "*", Job: "*", Image: "mirror.example/ebs@" + digestA}, image, ""},
		{"other image digest", PrivilegedGrant{Namespace: "*", Job: "*", Image: "registry.example/ebs@" + digestB}, image, "resolved to " + digestA + ", not " + digestB},
		{"image grant, binary task", PrivilegedGrant{Namespace: "*", Job: "*", Image: "registry.example/ebs@" + digestA}, base, "the task runs no image"},
		{"no image in grant, image task", PrivilegedGrant{Namespace: "storage", Job: "ebs-node"}, image, "the grant names no image: a task from an image needs a grant that names its digest"},
		{"every field", PrivilegedGrant{Namespace: "storage", Job: "ebs-node", PluginID: "ebs", Image: "r/ebs@" + digestA}, image, ""},
		{"every field, one off", PrivilegedGrant{Namespace: "storage", Job: "ebs-node", PluginID: "efs", Image: "r/ebs@" + digestA}, image, `grant is for plugin "efs"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := c.grant.mismatch(c.s)
			if c.want == "" {
				must.Eq(t, "", got)
				return
			}
			must.StrContains(t, got, c.want)
		})
	}
}

func TestMatchGrant(t *testing.T) {
	grants := []PrivilegedGrant{
		{Namespace: "other", Job: "secret-job"},
		{Namespace: "storage", Job: "ebs-node", PluginID: "efs"},
		{Namespace: "storage", Job: "ebs-*", PluginID: "ebs"},
	}
	s := grantSubject{Namespace: "storage", Job: "ebs-node", PluginID: "ebs"}
	g, why := matchGrant(grants, s)
	must.NotNil(t, g)
	must.Eq(t, grants[2], *g)
	must.SliceEmpty(t, why)

	s.PluginID = "fsx"
	g, why = matchGrant(grants, s)
	must.Nil(t, g)
	// Only the grants for the task's job are explained: another
	// namespace's trusted jobs are not the job author's business.
	must.Len(t, 2, why)
	must.StrContains(t, why[0], "privileged_grant[1]")
	must.StrContains(t, why[1], "privileged_grant[2]")
	must.StrNotContains(t, strings.Join(why, " "), "secret-job")

	g, _ = matchGrant(nil, s)
	must.Nil(t, g)
}

// The refusal's block pastes into the agent's config as it is, and the
// grant it makes matches the task.
func TestSuggestGrant_pastesAndMatches(t *testing.T) {
	for _, s := range []grantSubject{
		{Namespace: "default", Job: "hostpath"},
		{Namespace: "storage", Job: "ebs-node", PluginID: "ebs", Command: "/usr/local/bin/ebs"},
		{Namespace: "storage", Job: "ebs/dispatch-1-ab", PluginID: "ebs", ImageRef: "registry.example:5000/ebs:1.2", ImageDigest: digestA},
	} {
		block := suggestGrant(s)
		var c Config
		hclutils.NewConfigParser(configSpec).ParseHCL(t, "config {\n  "+block+"\n}", &c)
		must.Len(t, 1, c.PrivilegedGrants, must.Sprint(block))
		g := c.PrivilegedGrants[0]
		must.NoError(t, g.validate("privileged_grant[0]"))
		must.Eq(t, "", g.mismatch(s), must.Sprint(block))
		must.Eq(t, s.Namespace, g.Namespace)
		must.Eq(t, s.Job, g.Job)
		must.Eq(t, s.PluginID, g.PluginID)
		if s.ImageDigest != "" {
			must.Eq(t, "registry.example:5000/ebs@"+digestA, g.Image)
		}
		// And as HCL1, which the agent's config is.
		var raw map[string]any
		must.NoError(t, hcl.Decode(&raw, block), must.Sprint(block))
	}
}

func TestConfigSpec_privilegedGrant(t *testing.T) {
	var c Config
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {
  allow_privileged = true
  privileged_grant {
    namespace = "storage"
    job       = "ebs-node"
    command   = "/usr/local/bin/aws-ebs-csi-driver"
    plugin_id = "ebs"
  }
  privileged_grant {
    namespace = "storage"
    job       = "efs-*"
    image     = "registry.example/efs@`+digestA+`"
  }
  allow_user_groups = ["www-data", "33"]
}`, &c)
	must.Eq(t, []PrivilegedGrant{
		{Namespace: "storage", Job: "ebs-node", Command: "/usr/local/bin/aws-ebs-csi-driver", PluginID: "ebs"},
		{Namespace: "storage", Job: "efs-*", Image: "registry.example/efs@" + digestA},
	}, c.PrivilegedGrants)
	must.Eq(t, []string{"www-data", "33"}, c.AllowUserGroups)
	c.RootDir, c.CgroupParent = "/var/lib/nomad-driver-csi", "nomad-csi"
	must.NoError(t, c.validate())
}

// Config errors name the grant and its field.
func TestConfig_validateGrants(t *testing.T) {
	cases := []struct {
		name  string
		grant PrivilegedGrant
		want  string
	}{
		{"no namespace", PrivilegedGrant{Job: "j"}, "privileged_grant[1].namespace must not be empty"},
		{"no job", PrivilegedGrant{Namespace: "n", Job: " "}, "privileged_grant[1].job must not be empty"},
		{"relative command", PrivilegedGrant{Namespace: "n", Job: "j", Command: "bin/plugin"}, "privileged_grant[1].command must be the absolute, clean path"},
		{"unclean command", PrivilegedGrant{Namespace: "n", Job: "j", Command: "/usr/bin/../bin/plugin"}, "privileged_grant[1].command must be the absolute, clean path"},
		{"glob command", PrivilegedGrant{Namespace: "n", Job: "j", Command: "/usr/bin/*"}, "privileged_grant[1].command \"/usr/bin/*\" must be one path"},
		{"tag-only image", PrivilegedGrant{Namespace: "n", Job: "j", Image: "registry.example/ebs:1.2"}, "privileged_grant[1].image \"registry.example/ebs:1.2\" must be pinned by digest"},
		{"short digest", PrivilegedGrant{Namespace: "n", Job: "j", Image: "registry.example/ebs@sha256:abc"}, "privileged_grant[1].image"},
		{"digest alone", PrivilegedGrant{Namespace: "n", Job: "j", Image: digestA}, "privileged_grant[1].image"},
		{"upper-case digest", PrivilegedGrant{Namespace: "n", Job: "j", Image: "r/ebs@" + strings.ToUpper(digestA)}, "privileged_grant[1].image"},
		{"command and image", PrivilegedGrant{Namespace: "n", Job: "j", Command: "/bin/x", Image: "r/ebs@" + digestA}, "privileged_grant[1] sets both command and image"},
		{"bad plugin id", PrivilegedGrant{Namespace: "n", Job: "j", PluginID: "../x"}, "privileged_grant[1].plugin_id \"../x\" must be a csi_plugin id"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			conf := Config{RootDir: "/x", CgroupParent: "c", PrivilegedGrants: []PrivilegedGrant{{Namespace: "*", Job: "*"}, c.grant}}
			must.ErrorContains(t, conf.validate(), c.want)
		})
	}
	ok := PrivilegedGrant{Namespace: "n", Job: "j", Image: "registry.example:5000/ebs:1.2@" + digestA}
	must.NoError(t, ok.validate("privileged_grant[0]"))
	ok.Image = "r/ebs@sha512:" + strings.Repeat("c", 128)
	must.NoError(t, ok.validate("privileged_grant[0]"))

	conf := Config{RootDir: "/x", CgroupParent: "c", AllowUserGroups: []string{"ok", "a:b"}}
	must.ErrorContains(t, conf.validate(), `allow_user_groups[1] must be a group name or gid`)
}

// installRootBinary makes dir/name, an executable root's alone, in a
// directory root's alone.
func installRootBinary(t *testing.T, dir, name string) string {
	t.Helper()
	must.NoError(t, os.MkdirAll(dir, 0o755))
	p := filepath.Join(dir, name)
	must.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\nexit 0\n"), 0o755))
	must.NoError(t, os.Chmod(p, 0o755))
	return p
}

func TestResolveGrantCommand_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the command's files must be root's")
	}
	top := t.TempDir() // root's, 0700, under /tmp (sticky)
	bin := installRootBinary(t, filepath.Join(top, "bin"), "plugin")
	must.NoError(t, os.Symlink(bin, filepath.Join(top, "bin", "link")))
	path := "PATH=" + filepath.Join(top, "empty") + ":relative:" + filepath.Join(top, "bin")

	got, err := resolveGrantCommand("plugin", "/", []string{path}, nil, nil)
	must.NoError(t, err)
	must.Eq(t, bin, got)
	got, err = resolveGrantCommand("link", "/", []string{path}, nil, nil)
	must.NoError(t, err)
	must.Eq(t, bin, got, must.Sprint("compared by the real path"))
	got, err = resolveGrantCommand("bin/plugin", top, nil, nil, nil)
	must.NoError(t, err)
	must.Eq(t, bin, got, must.Sprint("relative to the working directory"))

	// A grant may name the file through a symlink of its own.
	must.NoError(t, os.Symlink(filepath.Join(top, "bin"), filepath.Join(top, "linked-bin")))
	must.True(t, sameCommand(filepath.Join(top, "linked-bin", "plugin"), bin))
	must.False(t, sameCommand(filepath.Join(top, "linked-bin", "link"), filepath.Join(top, "bin", "link")))

	// What the task sees there is its mount, not the host's file.
	_, err = resolveGrantCommand(bin, "/", nil, []string{filepath.Join(top, "bin")}, nil)
	must.ErrorContains(t, err, "inside the task's mount")
	_, err = resolveGrantCommand("link", "/", []string{path}, []string{bin}, nil)
	must.ErrorContains(t, err, "inside the task's mount")
	// Nor in a directory tasks write.
	_, err = resolveGrantCommand(bin, "/", nil, nil, []string{top})
	must.ErrorContains(t, err, "where tasks write")

	_, err = resolveGrantCommand("no-such-plugin", "/", []string{path}, nil, nil)
	must.ErrorContains(t, err, "not an executable file on the host")

	// Swappable: a file or a directory someone else owns or may write.
	must.NoError(t, os.Chmod(bin, 0o775))
	_, err = resolveGrantCommand(bin, "/", nil, nil, nil)
	must.ErrorContains(t, err, "writable by its group or by others")
	must.NoError(t, os.Chmod(bin, 0o755))
	must.NoError(t, os.Chown(bin, 65534, 0))
	_, err = resolveGrantCommand(bin, "/", nil, nil, nil)
	must.ErrorContains(t, err, "owned by uid 65534, not root")
	must.NoError(t, os.Chown(bin, 0, 0))
	must.NoError(t, os.Chmod(filepath.Join(top, "bin"), 0o777))
	_, err = resolveGrantCommand(bin, "/", nil, nil, nil)
	must.ErrorContains(t, err, "writable by its group or by others (mode 0777)")
	// A sticky directory keeps root's entries root's.
	must.NoError(t, os.Chmod(filepath.Join(top, "bin"), 0o777|os.ModeSticky))
	_, err = resolveGrantCommand(bin, "/", nil, nil, nil)
	must.NoError(t, err)
}

func TestPinnedEnvAndMounts(t *testing.T) {
	must.Eq(t, "", pinnedEnvVar([]string{"PATH=/bin", "CSI_ENDPOINT=unix:///csi/csi.sock", "NOMAD_TASK_DIR=/local", "OLD_PRELOAD=x",
		"AWS_REGION=eu-west-1", "PYTHONUNBUFFERED=1", "HOMEPAGE=x", "ENVIRONMENT=prod", "CSI_NODE_ID=n1"}))
	for _, kv := range []string{"LD_PRELOAD=/local/x.so", "LD_LIBRARY_PATH=/local", "LD_AUDIT=x", "NODE_OPTIONS=--require /local/x.js", "PYTHONPATH=/local", "GLIBC_TUNABLES=x", "BASH_ENV=/local/rc",
		// What else runs the job's code: OpenSSL's engines, bash's exported
		// functions and xtrace prompt, Lua's init, Python's warning
		// categories and bytecode cache, the AWS SDK's credential_process,
		// kubeconfig's exec plugins, git's commands, a home with all of
		// those in it.
		"OPENSSL_CONF=/local/engine.cnf", "BASH_FUNC_mount%%=() { /local/x; }", "SHELLOPTS=xtrace", "PS4=$(/local/x)",
		"LUA_INIT=@/local/x.lua", "PYTHONWARNINGS=ignore::x.Y", "PYTHONPYCACHEPREFIX=/local/pyc",
		"AWS_CONFIG_FILE=/local/aws", "AWS_SHARED_CREDENTIALS_FILE=/secrets/aws", "KUBECONFIG=/local/kube",
		"GIT_SSH_COMMAND=/local/x", "HOME=/local", "XDG_CONFIG_HOME=/local", "DOTNET_STARTUP_HOOKS=/local/x.dll",
		"CORECLR_PROFILER_PATH=/local/x.so", "PERL5DB=x", "GEM_PATH=/local"} {
		k, _, _ := strings.Cut(kv, "=")
		must.Eq(t, k, pinnedEnvVar([]string{"PATH=/bin", kv}))
	}

	must.Eq(t, "LD_PRELOAD", envName("LD_PRELOAD"))
	must.Eq(t, "BASH_FUNC_mount%%", envName("BASH_FUNC_mount%%"))
	must.Eq(t, `"LD_PRELOAD\x1b]0;x\a"`, envName("LD_PRELOAD\x1b]0;x\a"))

	for _, target := range []string{"/etc", "/etc/ld.so.preload", "/usr/lib", "/lib64", "/", "/usr/local/bin", "/opt/csi/bin/x", "/opt/csi", "/opt"} {
		must.NotEq(t, "", pinnedMountReason(target, []string{"/opt/csi/bin"}), must.Sprint(target))
	}
	for _, target := range []string{"/csi", "/local/csi", "/data", "/etc/resolv.conf", "/etc/hosts", "/opt/other", "/var/lib/x"} {
		must.Eq(t, "", pinnedMountReason(target, []string{"/opt/csi/bin"}), must.Sprint(target))
	}
}

func TestCheckPrivilegedUser(t *testing.T) {
	for _, ok := range []string{"", "root", "0", "root:root", "0:0", "root:shadow"} {
		must.NoError(t, checkPrivilegedUser(ok), must.Sprint(ok))
	}
	for _, bad := range []string{"nobody", "65534", "nobody:root", "1000:0"} {
		err := checkPrivilegedUser(bad)
		must.ErrorContains(t, err, "a privileged task runs as root only", must.Sprint(bad))
	}
}

func TestCheckUserGroup(t *testing.T) {
	conf := &Config{}
	// nobody's own group, by name and by number; no group at all.
	for _, ok := range []string{"nobody", "nobody:nogroup", "65534:65534", "nobody:65534", "root:root", "4242:4242"} {
		must.NoError(t, checkUserGroup(conf, ok), must.Sprint(ok))
	}
	for _, bad := range []string{"nobody:shadow", "65534:42", "nobody:0", "4242:0"} {
		err := checkUserGroup(conf, bad)
		must.ErrorContains(t, err, "is not a member of group", must.Sprint(bad))
		must.ErrorContains(t, err, "allow_user_groups")
	}
	must.ErrorContains(t, checkUserGroup(conf, "nobody:no-such-group-xyz"), `group "no-such-group-xyz"`)
	// The operator's list lets a group in, by name or by gid.
	must.NoError(t, checkUserGroup(&Config{AllowUserGroups: []string{"shadow"}}, "65534:42"))
	must.NoError(t, checkUserGroup(&Config{AllowUserGroups: []string{"42"}}, "nobody:shadow"))
}

// authorize end to end over a task's config: the reservation of a plugin
// id, the grant's refusal with its block, root only, the command pinned
// into the spec.
func TestAuthorize(t *testing.T) {
	plugin := func(id string) *PluginTaskConfig {
		return &PluginTaskConfig{ID: id, Type: "monolith", MountDir: "/csi"}
	}
	task := func(ns, job string) *drivers.TaskConfig {
		return &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: ns, JobID: job}
	}
	spec := func() *executor.Spec { return &executor.Spec{Command: "/bin/sh", Dir: "/", Env: []string{"PATH=/bin"}} }
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "hostpath", PluginID: "hp"},
		{Namespace: "storage", Job: "hostpath-controller", PluginID: "hp"},
		{Namespace: "ops", Job: "*"},
	}}

	// No grant: refused, with the block to add.
	_, err := authorize(conf, task("default", "evil"), &TaskConfig{Privileged: true, CSIPlugin: plugin("evil")}, spec(), taskImage{})
	must.ErrorContains(t, err, `privileged = true needs the operator's grant on this node, and no privileged_grant in the driver's plugin config matches job "evil" in namespace "default"`)
	must.ErrorContains(t, err, `privileged_grant { namespace = "default", job = "evil", plugin_id = "evil" }`)
	// No privilege asked: nothing to grant.
	g, err := authorize(conf, task("default", "evil"), &TaskConfig{CSIPlugin: &PluginTaskConfig{ID: "evil", Type: "controller", MountDir: "/csi"}}, spec(), taskImage{})
	must.NoError(t, err)
	must.Nil(t, g)

	// A reserved id: only the grants' jobs serve it, privileged or not.
	for _, tc := range []*TaskConfig{
		{Privileged: true, CSIPlugin: plugin("hp")},
		{CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "controller", MountDir: "/csi"}},
	} {
		_, err = authorize(conf, task("ops", "squatter"), tc, spec(), taskImage{})
		must.ErrorContains(t, err, `csi_plugin id "hp" is reserved on this node by the operator for the tasks of privileged_grant[0] { namespace = "storage", job = "hostpath", plugin_id = "hp" } and privileged_grant[1] { namespace = "storage", job = "hostpath-controller", plugin_id = "hp" }, which do not match job "squatter" in namespace "ops"`)
	}
	g, err = authorize(conf, task("storage", "hostpath"), &TaskConfig{Privileged: true, CSIPlugin: plugin("hp")}, spec(), taskImage{})
	must.NoError(t, err)
	must.Eq(t, conf.PrivilegedGrants[0], *g)
	_, err = authorize(conf, task("storage", "hostpath-controller"), &TaskConfig{CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "controller", MountDir: "/csi"}}, spec(), taskImage{})
	must.NoError(t, err)
	// A grant of privilege without plugin_id does not open a reserved id.
	_, err = authorize(conf, task("ops", "anything"), &TaskConfig{Privileged: true, CSIPlugin: plugin("ops-plugin")}, spec(), taskImage{})
	must.NoError(t, err)

	// Nomad's own plugin tasks: the id comes from the staging mount.
	nomad := task("default", "evil")
	nomad.Mounts = nomadPluginMounts("/var/lib/nomad/client", "a1")
	_, err = authorize(conf, nomad, &TaskConfig{Privileged: true}, spec(), taskImage{})
	must.ErrorContains(t, err, `privileged_grant { namespace = "default", job = "evil", plugin_id = "hostpath" }`)
	nomad.Namespace, nomad.JobID = "ops", "nomad-plugin"
	_, err = authorize(conf, nomad, &TaskConfig{Privileged: true}, spec(), taskImage{})
	must.NoError(t, err)
	conf2 := *conf
	conf2.PrivilegedGrants = append(conf2.PrivilegedGrants, PrivilegedGrant{Namespace: "storage", Job: "hostpath", PluginID: "hostpath"})
	_, err = authorize(&conf2, nomad, &TaskConfig{Privileged: true}, spec(), taskImage{})
	must.ErrorContains(t, err, `csi_plugin id "hostpath" is reserved on this node`)

	// A decoy: a volume the job mounted bidirectionally from Nomad's
	// state directory (a dynamic host volume registered there, with ACLs
	// off) ahead of the supervisor's staging mount. Read first, it made
	// the task pass for plugin "decoy" while Nomad registered "hostpath",
	// reserved for another job.
	decoy := task("ops", "nomad-plugin")
	decoy.Mounts = append([]*drivers.MountConfig{{TaskPath: "/decoy", HostPath: "/var/lib/nomad/client/csi/node/decoy", PropagationMode: "bidirectional"}},
		nomadPluginMounts("/var/lib/nomad/client", "a1")...)
	_, err = authorize(&conf2, decoy, &TaskConfig{Privileged: true}, spec(), taskImage{})
	must.ErrorContains(t, err, `the task has mounts of Nomad's csi_plugin staging directories of more than one plugin ("decoy", "hostpath")`)
	must.ErrorContains(t, err, "mount no volume from /var/lib/nomad/client/csi")
	_, err = authorize(&conf2, decoy, &TaskConfig{}, spec(), taskImage{})
	must.ErrorContains(t, err, "more than one plugin", must.Sprint("privileged or not"))

	// Root only, granted or not.
	nobody := task("ops", "x")
	nobody.User = "nobody"
	_, err = authorize(conf, nobody, &TaskConfig{Privileged: true, CSIPlugin: plugin("x")}, spec(), taskImage{})
	must.ErrorContains(t, err, "a privileged task runs as root only")

	// privileged_plugins_only still holds under a grant.
	_, err = authorize(conf, task("ops", "x"), &TaskConfig{Privileged: true}, spec(), taskImage{})
	must.ErrorContains(t, err, "privileged_plugins_only = true")
}

func TestAuthorize_pinnedCommand_Root(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the command's files must be root's")
	}
	top := t.TempDir()
	bin := installRootBinary(t, filepath.Join(top, "bin"), "plugin")
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "hp", Command: bin, PluginID: "hp"},
	}}
	cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "hp"}
	tc := &TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}
	spec := &executor.Spec{Command: "plugin", Dir: "/", Env: []string{"PATH=/local/bin:" + filepath.Join(top, "bin")},
		Mounts: []executor.Mount{{Source: "/x", Target: "/local"}, {Source: "/y", Target: "/csi"}}}

	// /local/bin/plugin comes first in PATH, but the job's /local is a
	// mount: the check stops there rather than run the host's file.
	_, err := authorize(conf, cfg, tc, spec, taskImage{})
	must.ErrorContains(t, err, `inside the task's mount "/local"`)
	must.ErrorContains(t, err, "privileged_grant[0]")

	spec.Env = []string{"PATH=" + filepath.Join(top, "bin")}
	g, err := authorize(conf, cfg, tc, spec, taskImage{})
	must.NoError(t, err)
	must.NotNil(t, g)
	must.Eq(t, bin, spec.Path, must.Sprint("the supervisor runs exactly the matched file"))

	// Another binary of the same job: no grant.
	other := installRootBinary(t, filepath.Join(top, "bin"), "shell")
	spec.Command, spec.Path = other, ""
	_, err = authorize(conf, cfg, tc, spec, taskImage{})
	must.ErrorContains(t, err, `csi_plugin id "hp" is reserved on this node`)
	must.ErrorContains(t, err, `privileged_grant[0]: the task's command resolves to "`+other+`", not "`+bin+`"`)
	// Without the reservation, the refusal of privilege says the same and
	// gives the block to add.
	conf.PrivilegedGrants[0].PluginID = ""
	_, err = authorize(conf, cfg, tc, spec, taskImage{})
	must.ErrorContains(t, err, `privileged_grant[0]: the task's command resolves to "`+other+`", not "`+bin+`"`)
	must.ErrorContains(t, err, `privileged_grant { namespace = "storage", job = "hp", command = "`+other+`", plugin_id = "hp" }`)
	conf.PrivilegedGrants[0].PluginID = "hp"
	must.Eq(t, "", spec.Path)

	// The pinned program loads none of the job's code.
	spec.Command = "plugin"
	spec.Env = []string{"PATH=" + filepath.Join(top, "bin"), "LD_PRELOAD=/local/x.so"}
	_, err = authorize(conf, cfg, tc, spec, taskImage{})
	must.ErrorContains(t, err, "env LD_PRELOAD is not allowed in this task")
	spec.Env = []string{"PATH=" + filepath.Join(top, "bin")}
	tc.Volumes = map[string]VolumeConfig{"v": {Destination: "/etc"}}
	_, err = authorize(conf, cfg, tc, spec, taskImage{})
	must.ErrorContains(t, err, `a mount at "/etc" would put the job's files into /etc`)
	tc.Volumes = nil

	// A task from an image never matches a command grant.
	_, err = authorize(conf, cfg, tc, spec, taskImage{Ref: "r/hp:1", Digest: digestA, Entrypoint: []string{"/hostpathplugin"}})
	must.ErrorContains(t, err, "the grant names no image: a task from an image needs a grant that names its digest")
}

// The agent's log says what the grants of a valid config leave surprising.
func TestWarnGrants(t *testing.T) {
	logged := func(c *Config) string {
		var buf strings.Builder
		warnGrants(hclog.New(&hclog.LoggerOptions{Output: &buf, Level: hclog.Warn}), c)
		return buf.String()
	}
	must.StrContains(t, logged(&Config{AllowPrivileged: true}), "every privileged task is refused")
	must.StrContains(t, logged(&Config{PrivilegedGrants: grantAll}), "give no privilege while allow_privileged = false")
	must.Eq(t, "", logged(&Config{AllowPrivileged: true, PrivilegedGrants: grantAll}))
	must.StrContains(t, logged(&Config{AllowPrivileged: true, PrivilegedGrants: []PrivilegedGrant{{Namespace: "*", Job: "*", Command: "/no/such/plugin"}}}),
		"privileged_grant[0]")
	if os.Geteuid() == 0 {
		// /bin/sh through its links: root's, as every system binary.
		must.Eq(t, "", logged(&Config{AllowPrivileged: true, PrivilegedGrants: []PrivilegedGrant{{Namespace: "*", Job: "*", Command: "/bin/sh"}}}))
	}
}

// The example agent configurations' driver config decodes and validates,
// their grants included.
func TestExampleAgentConfig(t *testing.T) {
	for file, want := range map[string][]PrivilegedGrant{
		"agent.hcl":         {{Namespace: "default", Job: "csi-plugin", Command: "/usr/local/bin/csi-fixture", PluginID: "fixture"}},
		"agent-minimal.hcl": {{Namespace: "default", Job: "csi-plugin", PluginID: "fixture"}},
	} {
		t.Run(file, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join("..", "examples", file))
			must.NoError(t, err)
			text := string(b)
			start := strings.Index(text, `plugin "nomad-driver-csi" {`)
			must.Positive(t, start+1, must.Sprint("no plugin \"nomad-driver-csi\" block"))
			i := strings.Index(text[start:], "config {")
			must.Positive(t, i, must.Sprint("no config block"))
			i += start
			depth, end := 0, -1
			for j := i; j < len(text) && end < 0; j++ {
				switch text[j] {
				case '{':
					depth++
				case '}':
					if depth--; depth == 0 {
						end = j + 1
					}
				}
			}
			must.Positive(t, end, must.Sprint("unbalanced config block"))
			var c Config
			hclutils.NewConfigParser(configSpec).ParseHCL(t, text[i:end], &c)
			if c.RootDir == "" {
				c.RootDir = DefaultRootDir
			}
			must.NoError(t, c.validate())
			must.True(t, c.AllowPrivileged)
			must.Eq(t, want, c.PrivilegedGrants)
		})
	}
}

// The digest the image store resolved is the grant check's input: a grant
// that names an image matches that digest only, never a task that runs a
// host binary; a task from an image needs such a grant.
func TestAuthorize_imageDigest(t *testing.T) {
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "ebs-node", Image: "registry.example/ebs@" + digestA, PluginID: "ebs"},
		{Namespace: "storage", Job: "hostpath"},
	}}
	task := func(job string) *drivers.TaskConfig {
		return &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: job}
	}
	tc := func(id string) *TaskConfig {
		return &TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: id, Type: "node", MountDir: "/csi"}}
	}
	spec := func() *executor.Spec { return &executor.Spec{Command: "/bin/aws-ebs-csi-driver", Dir: "/"} }

	g, err := authorize(conf, task("ebs-node"), tc("ebs"), spec(), taskImage{Ref: "registry.example/ebs:v1.2", Digest: digestA, Entrypoint: []string{"/bin/aws-ebs-csi-driver"}})
	must.NoError(t, err)
	must.Eq(t, conf.PrivilegedGrants[0], *g)

	// The tag moved to another image.
	_, err = authorize(conf, task("ebs-node"), tc("ebs"), spec(), taskImage{Ref: "registry.example/ebs:v1.2", Digest: digestB})
	must.ErrorContains(t, err, `csi_plugin id "ebs" is reserved on this node`)
	must.ErrorContains(t, err, `the task's image "registry.example/ebs:v1.2" resolved to `+digestB+", not "+digestA)
	conf.PrivilegedGrants[0].PluginID = ""
	_, err = authorize(conf, task("ebs-node"), tc("ebs"), spec(), taskImage{Ref: "registry.example/ebs:v1.2", Digest: digestB})
	must.ErrorContains(t, err, `privileged_grant { namespace = "storage", job = "ebs-node", image = "registry.example/ebs@`+digestB+`", plugin_id = "ebs" }`)

	// The same job running a host binary: the image grant is not for it.
	_, err = authorize(conf, task("ebs-node"), tc("ebs"), spec(), taskImage{})
	must.ErrorContains(t, err, "privileged_grant[0]: the task runs no image")

	// A grant without image is for host binaries only.
	_, err = authorize(conf, task("hostpath"), tc("hp"), spec(), taskImage{})
	must.NoError(t, err)
	_, err = authorize(conf, task("hostpath"), tc("hp"), spec(), taskImage{Ref: "registry.example/anything:latest", Digest: digestB})
	must.ErrorContains(t, err, "privileged_grant[1]: the task runs from image \"registry.example/anything:latest\"")
	must.ErrorContains(t, err, `image = "registry.example/anything@`+digestB+`"`)
}

// What the grant check adds to a privileged task's start: 50 grants, the
// task's matched last, with its command resolved and walked to the root
// (/bin/sh through the host's links).
func BenchmarkAuthorize(b *testing.B) {
	grants := make([]PrivilegedGrant, 0, 50)
	for i := range 49 {
		grants = append(grants, PrivilegedGrant{Namespace: "ns-*", Job: fmt.Sprintf("job-%d", i), PluginID: fmt.Sprintf("p%d", i)})
	}
	grants = append(grants, PrivilegedGrant{Namespace: "storage", Job: "ebs-*", Command: "/bin/sh", PluginID: "ebs"})
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: grants}
	cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "storage", JobID: "ebs-node"}
	tc := &TaskConfig{Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "ebs", Type: "node", MountDir: "/csi"}}
	spec := &executor.Spec{Command: "sh", Dir: "/", Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Mounts: []executor.Mount{{Target: "/alloc"}, {Target: "/local"}, {Target: "/secrets"}, {Target: "/csi"}}}
	if g, err := authorize(conf, cfg, tc, spec, taskImage{}); err != nil || g == nil {
		b.Fatalf("not granted: %v", err)
	}
	b.ResetTimer()
	for b.Loop() {
		spec.Path = ""
		if _, err := authorize(conf, cfg, tc, spec, taskImage{}); err != nil {
			b.Fatal(err)
		}
	}
}

// A grant without namespace or job does not get past the schema, which
// names the missing field.
func TestConfigSpec_grantRequiredFields(t *testing.T) {
	dec, diags := hclspecutils.Convert(configSpec)
	must.False(t, diags.HasErrors())
	for field, grant := range map[string]map[string]any{
		"job":       {"namespace": "storage"},
		"namespace": {"job": "ebs-node"},
	} {
		_, diags, _ := hclutils.ParseHclInterface(map[string]any{"privileged_grant": []any{grant}}, dec, nil)
		must.True(t, diags.HasErrors(), must.Sprint(field))
		must.StrContains(t, diags.Error(), `The argument "`+field+`" is required`)
	}
}

// A task with this driver's csi_plugin block and Nomad's together: Nomad
// registers the id of its own block from the task's socket whatever the
// driver's block says, so a job granted privilege for its own tooling (no
// plugin_id) served an id the operator reserved for another job by naming
// an unreserved one in config.
func TestAuthorize_bothPluginBlocks(t *testing.T) {
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi", PrivilegedGrants: []PrivilegedGrant{
		{Namespace: "storage", Job: "hostpath", PluginID: "hostpath"},
		{Namespace: "ops", Job: "*"},
	}}
	spec := &executor.Spec{Command: "/bin/sh", Dir: "/", Env: []string{"PATH=/bin"}}
	cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "ops", JobID: "tooling",
		Mounts: nomadPluginMounts("/var/lib/nomad/client", "a1")}
	own := &PluginTaskConfig{ID: "ops-plugin", Type: "monolith", MountDir: "/driver-csi"}
	for _, tc := range []*TaskConfig{
		{Privileged: true, CSIPlugin: own},
		{CSIPlugin: &PluginTaskConfig{ID: "ops-plugin", Type: "controller", MountDir: "/driver-csi"}},
	} {
		_, err := authorize(conf, cfg, tc, spec, taskImage{})
		must.ErrorContains(t, err, `this driver's csi_plugin block (id "ops-plugin", in config) and Nomad's csi_plugin block (id "hostpath", in the task): a task serves one plugin`)
	}
	// Each block alone: the reservation holds for Nomad's, the driver's
	// own id is the job's.
	_, err := authorize(conf, cfg, &TaskConfig{Privileged: true}, spec, taskImage{})
	must.ErrorContains(t, err, `csi_plugin id "hostpath" is reserved on this node`)
	_, err = authorize(conf, &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "ops", JobID: "tooling"}, &TaskConfig{Privileged: true, CSIPlugin: own}, spec, taskImage{})
	must.NoError(t, err)
	// The decoy of TestAuthorize is refused with the driver's block too.
	cfg.Mounts = append([]*drivers.MountConfig{{TaskPath: "/decoy", HostPath: "/var/lib/nomad/client/csi/node/decoy", PropagationMode: "bidirectional"}},
		nomadPluginMounts("/var/lib/nomad/client", "a1")...)
	_, err = authorize(conf, cfg, &TaskConfig{Privileged: true, CSIPlugin: own}, spec, taskImage{})
	must.ErrorContains(t, err, "more than one plugin")
}

// A dispatched or periodic job's tasks carry the child's id
// ("backup/dispatch-<time>-<id>", "backup/periodic-<time>"), a new one at
// every run: a grant's job "backup" matches none of them. The refusal
// says so, and the block it offers names every child of the parent, not
// the one run that was refused (which would match no later run).
func TestAuthorize_childJobsOfAParent(t *testing.T) {
	spec := func() *executor.Spec { return &executor.Spec{Command: "/bin/sh", Dir: "/", Env: []string{"PATH=/bin"}} }
	plugin := &PluginTaskConfig{ID: "bk", Type: "monolith", MountDir: "/csi"}
	conf := &Config{AllowPrivileged: true, PrivilegedPluginsOnly: true, RootDir: "/var/lib/nomad-driver-csi",
		PrivilegedGrants: []PrivilegedGrant{{Namespace: "ops", Job: "backup"}}}
	for _, child := range []string{"backup/dispatch-1700000000-ab12cd34", "backup/periodic-1700000000"} {
		t.Run(child, func(t *testing.T) {
			// As Nomad's client sends it: ParentJobID does not cross the
			// plugin SDK's gRPC boundary, the task's environment does.
			cfg := &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "ops", JobID: child,
				Env: map[string]string{"NOMAD_JOB_PARENT_ID": "backup"}}
			_, err := authorize(conf, cfg, &TaskConfig{Privileged: true, CSIPlugin: plugin}, spec(), taskImage{})
			must.ErrorContains(t, err, `matches job "`+child+`" in namespace "ops"; the job is a dispatched or periodic child of job "backup", and a grant's job "backup" matches none of its children, "backup/*" matches them all`)
			must.ErrorContains(t, err, `privileged_grant { namespace = "ops", job = "backup/*", plugin_id = "bk" }`)

			// The block offered, pasted, grants this run and the next.
			var c Config
			block := suggestGrant(grantSubject{Namespace: "ops", Job: child, Parent: "backup", PluginID: "bk"})
			hclutils.NewConfigParser(configSpec).ParseHCL(t, "config {\n  allow_privileged = true\n  "+block+"\n}", &c)
			c.PrivilegedPluginsOnly, c.RootDir = true, conf.RootDir
			for _, run := range []string{child, strings.Replace(child, "1700000000", "1700000060", 1)} {
				cfg.JobID = run
				_, err = authorize(&c, cfg, &TaskConfig{Privileged: true, CSIPlugin: plugin}, spec(), taskImage{})
				must.NoError(t, err, must.Sprint(block))
			}
		})
	}
	// A job whose id merely holds a slash is no one's child: its own id,
	// whatever its environment says.
	for _, env := range []map[string]string{nil, {"NOMAD_JOB_PARENT_ID": "backup"}} {
		_, err := authorize(conf, &drivers.TaskConfig{ID: "a1/t/1", AllocID: "a1", Namespace: "ops", JobID: "backup/x", Env: env},
			&TaskConfig{Privileged: true, CSIPlugin: plugin}, spec(), taskImage{})
		must.ErrorContains(t, err, `privileged_grant { namespace = "ops", job = "backup/x", plugin_id = "bk" }`)
		must.StrNotContains(t, err.Error(), "child")
	}
}
