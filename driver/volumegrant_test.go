package driver

import (
	"fmt"
	"strings"
	"testing"

	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/shoenig/test/must"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
)

// The volume_grant blocks as the agent's config writes them.
func TestConfigSpec_volumeGrant(t *testing.T) {
	var c Config
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {}`, &c)
	must.SliceEmpty(t, c.VolumeGrants)

	c = Config{}
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {
  volume_grant {
    namespace = "team-a"
    plugin_id = "nfs"
    volume_id = "team-a-*"
  }
  volume_grant {
    namespace = "team-b"
    job       = "pg-*"
    plugin_id = "*"
    volume_id = "pg/*"
  }
}`, &c)
	must.Eq(t, []VolumeGrant{
		{Namespace: "team-a", PluginID: "nfs", VolumeID: "team-a-*"},
		{Namespace: "team-b", Job: "pg-*", PluginID: "*", VolumeID: "pg/*"},
	}, c.VolumeGrants)
	c.RootDir, c.CgroupParent = "/var/lib/ncsi", "x"
	must.NoError(t, c.validate())
}

func TestVolumeGrant_validate(t *testing.T) {
	for _, tc := range []struct {
		g    VolumeGrant
		want string
	}{
		{VolumeGrant{PluginID: "nfs", VolumeID: "*"}, `volume_grant[2].namespace must not be empty: name what the grant is for, such as "team-a"`},
		{VolumeGrant{Namespace: "a", VolumeID: "*"}, `volume_grant[2].plugin_id must not be empty`},
		{VolumeGrant{Namespace: "a", PluginID: "nfs", VolumeID: " "}, `volume_grant[2].volume_id must not be empty`},
		{VolumeGrant{Namespace: "a", Job: "  ", PluginID: "nfs", VolumeID: "*"}, `volume_grant[2].job must be a job id or a glob, or left out for any job, got "  "`},
	} {
		c := Config{RootDir: "/var/lib/ncsi", CgroupParent: "x", VolumeGrants: []VolumeGrant{
			{Namespace: "*", PluginID: "*", VolumeID: "*"}, {Namespace: "*", PluginID: "*", VolumeID: "*"}, tc.g}}
		must.ErrorContains(t, c.validate(), tc.want)
	}
}

func TestCheckVolumeGrants(t *testing.T) {
	grants := []VolumeGrant{
		{Namespace: "team-a", PluginID: "nfs", VolumeID: "team-a-*"},
		{Namespace: "team-b", Job: "pg", PluginID: "nfs", VolumeID: "pg-data"},
		{Namespace: "team-?", PluginID: "scratch", VolumeID: "*"},
	}
	vol := func(plugin, id string) map[string]VolumeConfig {
		return map[string]VolumeConfig{"data": {PluginID: plugin, VolumeID: id}}
	}
	a := jobRef{namespace: "team-a", id: "web"}
	b := jobRef{namespace: "team-b", id: "pg"}
	bOther := jobRef{namespace: "team-b", id: "web"}
	c := jobRef{namespace: "default", id: "web"}

	// No grants: every volume, as before grants.
	must.NoError(t, checkVolumeGrants(nil, c, vol("nfs", "team-a-home")))

	must.NoError(t, checkVolumeGrants(grants, a, vol("nfs", "team-a-home")))
	must.NoError(t, checkVolumeGrants(grants, b, vol("nfs", "pg-data")))
	must.NoError(t, checkVolumeGrants(grants, a, vol("scratch", "anything/at/all")))
	must.NoError(t, checkVolumeGrants(grants, bOther, vol("scratch", "x")))

	// Another namespace's volume.
	err := checkVolumeGrants(grants, b, vol("nfs", "team-a-home"))
	must.ErrorContains(t, err, `volume "data": volume_id "team-a-home" of plugin "nfs" is not granted to job "pg" in namespace "team-b" on this node`)
	must.ErrorContains(t, err, `the grants for this namespace and job are volume_grant[1]: plugin_id "nfs", volume_id "pg-data"; volume_grant[2]: plugin_id "scratch", volume_id "*"`)
	must.ErrorContains(t, err, "have the operator add a volume_grant block")
	// The grants of other namespaces are not named.
	must.StrNotContains(t, err.Error(), "team-a-*")

	// A grant for another job of the namespace.
	err = checkVolumeGrants(grants, bOther, vol("nfs", "pg-data"))
	must.ErrorContains(t, err, `not granted to job "web" in namespace "team-b"`)
	must.StrNotContains(t, err.Error(), `volume_grant[1]`)

	// The right id of the wrong plugin; a glob's '*' takes slashes too.
	must.Error(t, checkVolumeGrants(grants, a, vol("nfs2", "team-a-home")))
	must.NoError(t, checkVolumeGrants(grants, a, vol("nfs", "team-a-x/y/z")))
	// A ".." segment is never granted, whatever a '*' would match.
	for _, id := range []string{"team-a-x/../../team-b", "team-a-x/..", "../team-a-x", "team-a-../.."} {
		err := checkVolumeGrants(grants, a, vol("nfs", id))
		must.ErrorContains(t, err, `path segment, which no volume_grant matches`, must.Sprint(id))
	}
	must.NoError(t, checkVolumeGrants(grants, a, vol("nfs", "team-a-x/..hidden/y..")))
	// An id past csihook.MaxIDBytes is not matched at all.
	err = checkVolumeGrants(grants, a, vol("nfs", "team-a-"+strings.Repeat("x", csihook.MaxIDBytes)))
	must.ErrorContains(t, err, "is longer than 1024 bytes, which no grant matches")
	must.True(t, len(err.Error()) < 512)

	// A namespace no grant names.
	err = checkVolumeGrants(grants, c, vol("scratch", "x"))
	must.ErrorContains(t, err, "(no volume_grant names this namespace and job)")

	// Every volume of the task is checked.
	two := vol("nfs", "team-a-home")
	two["other"] = VolumeConfig{PluginID: "nfs", VolumeID: "pg-data"}
	must.ErrorContains(t, checkVolumeGrants(grants, a, two), `volume "other": volume_id "pg-data"`)
}

func TestVolumeGrant_String(t *testing.T) {
	must.Eq(t, `volume_grant { namespace = "a", plugin_id = "nfs", volume_id = "a-*" }`,
		VolumeGrant{Namespace: "a", PluginID: "nfs", VolumeID: "a-*"}.String())
	must.Eq(t, `volume_grant { namespace = "a", job = "pg", plugin_id = "nfs", volume_id = "a-*" }`,
		VolumeGrant{Namespace: "a", Job: "pg", PluginID: "nfs", VolumeID: "a-*"}.String())
}

// grantsDriver is a driver of conf with the fake plugin "hp" served by a
// privileged plugin task and healthy, and the task config of a volume of
// it with the given id.
func grantsDriver(t *testing.T, conf Config) (*testDriver, *fakePlugins, func(id string) TaskConfig) {
	t.Helper()
	d := newTestDriver(t, conf)
	fp := withFakePlugins(t, d)
	plugin := TaskConfig{Command: "/bin/plugin", Privileged: true, CSIPlugin: &PluginTaskConfig{ID: "hp", Type: "monolith", MountDir: "/csi"}}
	_, _, err := d.StartTask(jobTask(t, plugin, "alloc-p", "default", "plugin"))
	must.NoError(t, err)
	waitHealthy(t, d, "hp")
	return d, fp, func(id string) TaskConfig {
		return TaskConfig{Command: "/bin/sleep", Volumes: map[string]VolumeConfig{"data": {
			PluginID: "hp", VolumeID: id, Destination: "/data", AccessMode: "multi-node-multi-writer", AttachmentMode: "file-system",
		}}}
	}
}

// A task of a namespace the grants do not give the volume to is refused
// before any call to the plugin; the granted namespace's task starts.
func TestVolumes_grantsRefuseBeforeAnyCall(t *testing.T) {
	d, fp, vol := grantsDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll,
		VolumeGrants: []VolumeGrant{{Namespace: "team-a", PluginID: "hp", VolumeID: "a-*"}}})
	_, _, err := d.StartTask(jobTask(t, vol("a-1"), "alloc-b", "team-b", "web"))
	must.ErrorContains(t, err, `volume "data": volume_id "a-1" of plugin "hp" is not granted to job "web" in namespace "team-b"`)
	must.Eq(t, 0, len(fp.vols.Calls()))

	_, _, err = d.StartTask(jobTask(t, vol("a-1"), "alloc-a", "team-a", "web"))
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))

	_, _, err = d.StartTask(jobTask(t, vol("b-1"), "alloc-a2", "team-a", "web"))
	must.ErrorContains(t, err, `volume_id "b-1" of plugin "hp" is not granted`)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))

	// A dispatched job's task has the child's id, which a grant for its
	// parent's id does not match: the refusal says what does.
	d, fp, vol = grantsDriver(t, Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll,
		VolumeGrants: []VolumeGrant{{Namespace: "team-a", Job: "backup", PluginID: "hp", VolumeID: "a-*"}}})
	child := jobTask(t, vol("a-1"), "alloc-c", "team-a", "backup/dispatch-1700000000-ab12cd34")
	child.Env = map[string]string{"NOMAD_JOB_PARENT_ID": "backup"}
	_, _, err = d.StartTask(child)
	must.ErrorContains(t, err, `is not granted to job "backup/dispatch-1700000000-ab12cd34" in namespace "team-a" on this node (no volume_grant names this namespace and job)`)
	must.ErrorContains(t, err, `; the job is a dispatched or periodic child of job "backup", and a grant's job "backup" matches none of its children, "backup/*" matches them all`)
	must.Eq(t, 0, len(fp.vols.Calls()))
}

// The refusal quotes what the job wrote cut short, as Validate does: the
// grant check runs before the ids' sizes are checked, and a job can write
// ids and a volume name of megabytes (what Nomad hands the driver in one
// call), which would otherwise reach the task's events and Nomad's state
// whole, and grow fourfold where %q escapes them.
func TestCheckVolumeGrants_refusalBounded(t *testing.T) {
	grants := []VolumeGrant{{Namespace: "team-b", PluginID: "nfs", VolumeID: "b-*"}}
	b := jobRef{namespace: "team-b", id: "web"}
	long := "a-" + strings.Repeat("\x01", 1<<20)
	for _, tc := range []struct {
		vols    map[string]VolumeConfig
		bytes   int
		tooLong bool
	}{
		{map[string]VolumeConfig{"data": {PluginID: "nfs", VolumeID: long}}, len(long), true},
		{map[string]VolumeConfig{"data": {PluginID: "nfs" + long, VolumeID: "b-1"}}, len("nfs" + long), true},
		{map[string]VolumeConfig{long: {PluginID: "nfs", VolumeID: "a-1"}}, len(long), false},
	} {
		err := checkVolumeGrants(grants, b, tc.vols)
		if tc.tooLong {
			must.ErrorContains(t, err, "is longer than 1024 bytes, which no grant matches")
		} else {
			must.ErrorContains(t, err, `is not granted to job "web" in namespace "team-b"`)
			must.ErrorContains(t, err, `volume_grant[0]: plugin_id "nfs", volume_id "b-*"`)
		}
		must.ErrorContains(t, err, fmt.Sprintf("... (%d bytes)", tc.bytes))
		must.Less(t, 1024, len(err.Error()))
	}
}

// What the grant check costs for a hostile volume_id of growing size,
// matched against the grants of its own namespace, each with a '*' the id
// keeps almost matching after: ns/op grows with the id's size times the
// patterns' (grantGlob backtracks to the last '*' only), never with its
// square; an id past csihook.MaxIDBytes (1 MiB here, about 4 MiB is what
// Nomad hands the driver in one call) is refused before any match.
func BenchmarkCheckVolumeGrants(b *testing.B) {
	grants := make([]VolumeGrant, 0, 20)
	for i := range 20 {
		grants = append(grants, VolumeGrant{Namespace: "team-b", PluginID: "*", VolumeID: fmt.Sprintf("b-*-data-%d-*x", i)})
	}
	job := jobRef{namespace: "team-b", id: "web"}
	for _, size := range []int{256, 1000, 1 << 20} {
		id := "b-" + strings.Repeat("-data-1-", size/8)
		vols := map[string]VolumeConfig{"data": {PluginID: "nfs", VolumeID: id}}
		if checkVolumeGrants(grants, job, vols) == nil {
			b.Fatal("granted")
		}
		b.Run(fmt.Sprintf("id=%dB", len(id)), func(b *testing.B) {
			b.SetBytes(int64(len(id)))
			b.ReportAllocs()
			for b.Loop() {
				_ = checkVolumeGrants(grants, job, vols)
			}
		})
	}
}

// Grants hold whatever else the config says and whenever it was given:
// allow_cross_namespace_volumes lets namespaces share a volume on a node,
// not past the grants; a task Nomad hands without a namespace is matched
// as "default", as its volumes' owner is recorded; and a config given
// again (SetConfig called twice in one driver process) brings its grants.
func TestVolumes_grantsWithCrossNamespaceAndNewConfig(t *testing.T) {
	conf := Config{Enabled: true, AllowPrivileged: true, PrivilegedGrants: grantAll, AllowCrossNamespaceVolumes: true,
		VolumeGrants: []VolumeGrant{
			{Namespace: "team-a", PluginID: "hp", VolumeID: "a-*"},
			{Namespace: "default", PluginID: "hp", VolumeID: "d-*"},
		}}
	d, fp, vol := grantsDriver(t, conf)

	// A's volume, published here for A: B is refused all the same.
	_, _, err := d.StartTask(jobTask(t, vol("a-1"), "alloc-a", "team-a", "web"))
	must.NoError(t, err)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))
	_, _, err = d.StartTask(jobTask(t, vol("a-1"), "alloc-b", "team-b", "web"))
	must.ErrorContains(t, err, `volume_id "a-1" of plugin "hp" is not granted to job "web" in namespace "team-b"`)
	must.Eq(t, 1, fp.vols.Count(csihook.MethodNodePublishVolume))

	// No namespace from Nomad: the default namespace's grants.
	_, _, err = d.StartTask(jobTask(t, vol("a-1"), "alloc-n1", "", "web"))
	must.ErrorContains(t, err, `not granted to job "web" in namespace "default"`)
	must.ErrorContains(t, err, `volume_grant[1]: plugin_id "hp", volume_id "d-*"`)
	_, _, err = d.StartTask(jobTask(t, vol("d-1"), "alloc-n2", "", "web"))
	must.NoError(t, err)
	must.Eq(t, 2, fp.vols.Count(csihook.MethodNodePublishVolume))

	// The config again, with B's grant: B gets its own ids, still not A's.
	conf = *d.currentConfig()
	conf.VolumeGrants = append(conf.VolumeGrants, VolumeGrant{Namespace: "team-b", PluginID: "hp", VolumeID: "b-*"})
	must.NoError(t, setConfig(d.Driver, conf))
	_, _, err = d.StartTask(jobTask(t, vol("a-1"), "alloc-b2", "team-b", "web"))
	must.ErrorContains(t, err, `volume_grant[2]: plugin_id "hp", volume_id "b-*"`)
	_, _, err = d.StartTask(jobTask(t, vol("b-1"), "alloc-b3", "team-b", "web"))
	must.NoError(t, err)
	must.Eq(t, 3, fp.vols.Count(csihook.MethodNodePublishVolume))
}
