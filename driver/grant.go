package driver

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"
)

// PrivilegedGrant is one privileged_grant block of the agent's plugin
// config: the operator's permission for the tasks of some jobs to run
// privileged, and, with PluginID, the reservation of a plugin id for them.
// A task is granted by a grant that matches every field the grant sets.
type PrivilegedGrant struct {
	// Namespace and Job are globs (grantGlob) over the task's Nomad
	// namespace and job id. Required.
	Namespace string `codec:"namespace"`
	Job       string `codec:"job"`
	// Command is the absolute host path of the executable the task must
	// run, compared with the real path its command resolves to in the
	// task's view (see resolveGrantCommand). "": any.
	Command string `codec:"command"`
	// Image is "repo@sha256:<hex>": the task must run from an image whose
	// manifest for the node's platform has that digest. "": a task that
	// runs a host binary, never one from an image.
	Image string `codec:"image"`
	// PluginID is the csi_plugin id the task serves. Set, it reserves the
	// id on the node: a task of no grant naming it may serve it.
	PluginID string `codec:"plugin_id"`
}

// privilegedGrantSpec is the repeatable privileged_grant block.
var privilegedGrantSpec = hclspec.NewBlockList("privileged_grant", hclspec.NewObject(map[string]*hclspec.Spec{
	"namespace": hclspec.NewAttr("namespace", "string", true),
	"job":       hclspec.NewAttr("job", "string", true),
	"command":   hclspec.NewAttr("command", "string", false),
	"image":     hclspec.NewAttr("image", "string", false),
	"plugin_id": hclspec.NewAttr("plugin_id", "string", false),
}))

// imageDigestRef is an image reference pinned by digest: a repository,
// optionally with a tag, and "@algorithm:hex".
var imageDigestRef = regexp.MustCompile(`^([^@\s]+)@((sha256):[a-f0-9]{64}|(sha512):[a-f0-9]{128})$`)

// String is the grant as a one-line block of the agent's config (HCL1).
func (g PrivilegedGrant) String() string { return "privileged_grant " + g.body() }

// body is the grant's block body, "{ namespace = ..., job = ... }".
func (g PrivilegedGrant) body() string {
	var b strings.Builder
	fmt.Fprintf(&b, "{ namespace = %q, job = %q", g.Namespace, g.Job)
	if g.Command != "" {
		fmt.Fprintf(&b, ", command = %q", g.Command)
	}
	if g.Image != "" {
		fmt.Fprintf(&b, ", image = %q", g.Image)
	}
	if g.PluginID != "" {
		fmt.Fprintf(&b, ", plugin_id = %q", g.PluginID)
	}
	b.WriteString(" }")
	return b.String()
}

// pins reports whether g (nil: no grant) pins the program its tasks run,
// by command or by image.
func (g *PrivilegedGrant) pins() bool { return g != nil && (g.Command != "" || g.Image != "") }

// digest is the digest of Image ("sha256:..."), or "".
func (g PrivilegedGrant) digest() string {
	if m := imageDigestRef.FindStringSubmatch(g.Image); m != nil {
		return m[2]
	}
	return ""
}

// validate checks one grant; key names it ("privileged_grant[0]").
func (g PrivilegedGrant) validate(key string) error {
	for _, f := range []struct{ name, value string }{{"namespace", g.Namespace}, {"job", g.Job}} {
		if strings.TrimSpace(f.value) == "" {
			return fmt.Errorf("%s.%s must not be empty: name the Nomad %s whose tasks may run privileged, such as %q (a glob: \"*\" matches any run of characters)",
				key, f.name, f.name, map[string]string{"namespace": "storage", "job": "ebs-node"}[f.name])
		}
	}
	if g.Command != "" {
		if !strings.HasPrefix(g.Command, "/") || filepath.Clean(g.Command) != g.Command {
			return fmt.Errorf("%s.command must be the absolute, clean path of the executable on the host, such as \"/usr/local/bin/aws-ebs-csi-driver\", got %q", key, g.Command)
		}
		if strings.ContainsAny(g.Command, "*?[") {
			return fmt.Errorf("%s.command %q must be one path, not a glob", key, g.Command)
		}
	}
	if g.Command != "" && g.Image != "" {
		return fmt.Errorf("%s sets both command and image: set one; a task from an image runs what the image holds, which its digest pins, and command names a host file", key)
	}
	if g.Image != "" && !imageDigestRef.MatchString(g.Image) {
		return fmt.Errorf("%s.image %q must be pinned by digest, such as \"registry.example/ebs@sha256:<64 hex digits>\": a tag can be moved to another image by whoever can push to the repository", key, g.Image)
	}
	if g.PluginID != "" && !validPluginID.MatchString(g.PluginID) {
		return fmt.Errorf("%s.plugin_id %q must be a csi_plugin id: it starts with a letter or digit and holds only letters, digits, '.', '_' and '-'", key, g.PluginID)
	}
	return nil
}

// grantGlob reports whether value matches pattern, in which '*' stands for
// any run of characters (slashes included: a dispatched job's id is
// "<parent>/dispatch-...") and '?' for one; every other character stands
// for itself.
func grantGlob(pattern, value string) bool {
	p, v := []rune(pattern), []rune(value)
	// Iterative matching with one backtrack point for the last '*'.
	pi, vi, star, mark := 0, 0, -1, 0
	for vi < len(v) {
		switch {
		case pi < len(p) && (p[pi] == '?' || p[pi] == v[vi]) && p[pi] != '*':
			pi++
			vi++
		case pi < len(p) && p[pi] == '*':
			star, mark = pi, vi
			pi++
		case star >= 0:
			pi = star + 1
			mark++
			vi = mark
		default:
			return false
		}
	}
	for pi < len(p) && p[pi] == '*' {
		pi++
	}
	return pi == len(p)
}

// grantSubject is what a grant is matched against: what the driver itself
// knows of a task that is starting.
type grantSubject struct {
	// Namespace and Job are the task's Nomad namespace and job id.
	Namespace, Job string
	// Parent is the id of the job Job is a dispatched or periodic child
	// of ("" for any other job; see childOf).
	Parent string
	// PluginID is the csi_plugin id the task serves (this driver's block
	// or Nomad's), "" for none.
	PluginID string
	// Command is the real host path the task's command resolves to in
	// the task's view, when it is a file a job cannot swap; CommandErr
	// says why there is none (a command grant then matches nothing).
	Command    string
	CommandErr error
	// ImageRef and ImageDigest are the image the task starts from, as the
	// job wrote it and as resolved (the platform manifest's digest); both
	// "" for a task that runs a host binary.
	ImageRef, ImageDigest string
	// ImageIndexDigest is the digest of the multi-platform index
	// ImageDigest was picked from ("" when the reference named one
	// manifest): an operator who pinned the index (what a registry shows
	// for a multi-platform tag) names that one.
	ImageIndexDigest string
}

// mismatch says why g does not match s, or "" when it does.
func (g PrivilegedGrant) mismatch(s grantSubject) string {
	switch {
	case !grantGlob(g.Namespace, s.Namespace):
		return fmt.Sprintf("namespace %q is not %q", s.Namespace, g.Namespace)
	case !grantGlob(g.Job, s.Job):
		return fmt.Sprintf("job %q is not %q", s.Job, g.Job)
	case g.PluginID != "" && s.PluginID == "":
		return fmt.Sprintf("the task serves no csi_plugin, and the grant is for plugin %q", g.PluginID)
	case g.PluginID != "" && s.PluginID != g.PluginID:
		return fmt.Sprintf("the task serves csi_plugin %q, and the grant is for plugin %q", s.PluginID, g.PluginID)
	case g.Image != "" && s.ImageDigest == "":
		return fmt.Sprintf("the task runs no image, and the grant is for image %q", g.Image)
	case g.Image == "" && s.ImageDigest != "":
		// Any image a job names is anything at all: a task from an image
		// is granted only by its digest.
		return fmt.Sprintf("the task runs from image %q (%s), and the grant names no image: a task from an image needs a grant that names its digest", s.ImageRef, s.ImageDigest)
	case g.Image != "" && s.ImageDigest != g.digest() && (s.ImageIndexDigest == "" || s.ImageIndexDigest != g.digest()):
		return fmt.Sprintf("the task's image %q resolved to %s, not %s", s.ImageRef, s.ImageDigest, g.digest())
	case g.Command != "" && s.Command == "" && s.CommandErr != nil:
		return fmt.Sprintf("the grant is for command %q: %v", g.Command, s.CommandErr)
	case g.Command != "" && !sameCommand(g.Command, s.Command):
		return fmt.Sprintf("the task's command resolves to %q, not %q", s.Command, g.Command)
	}
	return ""
}

// sameCommand reports whether a grant's command names the file at real (a
// path without symlinks): as written, or once its own symlinks are
// resolved ("/bin/x" where /bin is a link to usr/bin).
func sameCommand(grant, real string) bool {
	if grant == real {
		return true
	}
	r, err := filepath.EvalSymlinks(grant)
	return err == nil && r == real
}

// matchGrant returns the first grant that matches s, in the config's
// order, or nil and why each grant for the task's job did not (grants of
// other namespaces or jobs are not named: a job's author learns nothing of
// whom else the operator trusts).
func matchGrant(grants []PrivilegedGrant, s grantSubject) (*PrivilegedGrant, []string) {
	return matchGrantWhere(grants, s, func(PrivilegedGrant) bool { return true })
}

// matchGrantWhere is matchGrant among the grants for which where is true.
func matchGrantWhere(grants []PrivilegedGrant, s grantSubject, where func(PrivilegedGrant) bool) (*PrivilegedGrant, []string) {
	var why []string
	for i := range grants {
		g := &grants[i]
		// Grants of other jobs are passed over first, without the
		// formatting of a reason.
		if !where(*g) || !grantGlob(g.Namespace, s.Namespace) || !grantGlob(g.Job, s.Job) {
			continue
		}
		reason := g.mismatch(s)
		if reason == "" {
			return g, nil
		}
		why = append(why, fmt.Sprintf("privileged_grant[%d]: %s", i, reason))
	}
	return nil, why
}

// indexedGrant is a grant and its index in the config.
type indexedGrant struct {
	index int
	grant PrivilegedGrant
}

// reserving lists the grants that reserve plugin id.
func reserving(grants []PrivilegedGrant, id string) []indexedGrant {
	var out []indexedGrant
	for i, g := range grants {
		if g.PluginID == id {
			out = append(out, indexedGrant{i, g})
		}
	}
	return out
}

// suggestGrant is a privileged_grant block that would match s, ready to
// paste into the agent's plugin config block (HCL1, one line so that it
// reads whole in a task event): its namespace and job, the plugin it
// serves, and the image or command it runs when the driver could pin one.
// A child of a dispatched or periodic job gets its parent's children: its
// own id matches no later run.
func suggestGrant(s grantSubject) string {
	g := PrivilegedGrant{Namespace: s.Namespace, Job: s.Job, PluginID: s.PluginID}
	if s.Parent != "" && !strings.ContainsAny(s.Parent, "*?") {
		g.Job = s.Parent + "/*"
	}
	switch {
	case s.ImageDigest != "":
		g.Image = imageRepo(s.ImageRef) + "@" + s.ImageDigest
	case s.Command != "":
		g.Command = s.Command
	}
	return g.String()
}

// imageRepo is a reference without its tag or digest ("registry:5000/csi"
// from "registry:5000/csi:1.2@sha256:...").
func imageRepo(ref string) string {
	if i := strings.IndexByte(ref, '@'); i >= 0 {
		ref = ref[:i]
	}
	if i := strings.LastIndexByte(ref, ':'); i > strings.LastIndexByte(ref, '/') {
		ref = ref[:i]
	}
	return ref
}

// warnGrants logs what in the grants of a valid config would surprise an
// operator: privilege allowed with no grant (every privileged task is
// refused: an agent upgraded without grants), grants that allow_privileged
// = false makes void, and a command that a task could not run under its
// grant as the file is now.
func warnGrants(logger hclog.Logger, c *Config) {
	switch {
	case c.AllowPrivileged && len(c.PrivilegedGrants) == 0:
		logger.Warn("allow_privileged = true but no privileged_grant: every privileged task is refused; add a privileged_grant block for each plugin job")
	case !c.AllowPrivileged && len(c.PrivilegedGrants) > 0:
		logger.Warn("privileged_grant blocks give no privilege while allow_privileged = false (their plugin_id reservations hold)")
	}
	for i, g := range c.PrivilegedGrants {
		if g.Command == "" {
			continue
		}
		real, err := filepath.EvalSymlinks(g.Command)
		if err == nil {
			err = checkUnswappable(real)
		}
		if err != nil {
			logger.Warn("a privileged_grant's command cannot be run as it is: tasks under it are refused until it is a file only root can replace",
				"grant", fmt.Sprintf("privileged_grant[%d]", i), "command", g.Command, "error", err)
		}
	}
}

// childHint says, for a child job refused by the grants, that a grant
// names the parent's children by a glob; "" for any other job.
func childHint(parent string) string {
	if parent == "" {
		return ""
	}
	return fmt.Sprintf("; the job is a dispatched or periodic child of job %q, and a grant's job %q matches none of its children, %q matches them all",
		parent, parent, parent+"/*")
}
