package wire

import (
	"time"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/cgroups"
)

// Propagation modes of a Mount, in Nomad's spelling.
const (
	PropagationPrivate       = "private"
	PropagationHostToTask    = "host-to-task"
	PropagationBidirectional = "bidirectional"
)

// Mount is a host path bound into the task's mount namespace.
type Mount struct {
	// Source is the absolute host path (a directory, file or device node).
	Source string `json:"source"`
	// Target is the absolute path inside the task. It is created when
	// missing (a directory, or an empty file when Source is not one).
	Target   string `json:"target"`
	ReadOnly bool   `json:"read_only"`
	// Propagation is one of the Propagation* constants; empty means
	// PropagationPrivate. Bidirectional requires a privileged task.
	Propagation string `json:"propagation"`
	// NoSuid and NoDev make the mount (and its submounts) nosuid and
	// nodev in the task.
	NoSuid bool `json:"nosuid,omitempty"`
	NoDev  bool `json:"nodev,omitempty"`
	// Beneath, when set, is a directory above Source whose own path is
	// trusted: the rest of Source, below it, is resolved without
	// following any symlink when the source is taken. It is for sources
	// in directories that tasks can write (a task's directories, the
	// allocation's shared alloc/), where a task could have put a symlink
	// in place of Source to have the host path it names mounted instead.
	// It holds where a source is cloned (the late mounts of an isolated
	// task, and the supervisor's early clones); a privileged task's early
	// binds go by path, as such a task has the host anyway.
	Beneath string `json:"beneath,omitempty"`
}

// Spec describes the task process. It is written as JSON into StateDir and
// read by the supervisor, so it must not hold anything that cannot be
// stored there (the task's environment may hold secrets: StateDir is 0700).
type Spec struct {
	TaskID string `json:"task_id"`
	// StateDir is a directory private to this task (0700), created by the
	// caller. The supervisor keeps its spec, log and exit status there.
	StateDir string `json:"state_dir"`

	Command string `json:"command"`
	// Path, when set, is the executable to run, already resolved by the
	// driver (an absolute path in the task's view): the supervisor runs
	// it without searching PATH, with Command as argv[0]. The driver sets
	// it where it checked what the task runs (a privileged_grant command).
	Path string   `json:"path,omitempty"`
	Args []string `json:"args"`
	// Env is KEY=VALUE pairs, exactly the task's environment.
	Env []string `json:"env"`
	// Dir is the working directory.
	Dir string `json:"dir"`
	// User is a user name or numeric uid ("" means root), optionally
	// "user:group".
	User string `json:"user"`
	// Credential, when set, is who the task runs as, resolved by the
	// driver (an image task's user is looked up in the image's
	// /etc/passwd and /etc/group, never the host's): User is then only
	// its name in messages.
	Credential *Credential `json:"credential,omitempty"`

	// StdoutPath and StderrPath are Nomad's log FIFOs (or plain files).
	StdoutPath string `json:"stdout_path"`
	StderrPath string `json:"stderr_path"`

	// Privileged keeps every capability; otherwise the task keeps only
	// DefaultCapabilities (plus Capabilities, when set, in place of them).
	Privileged   bool     `json:"privileged"`
	Capabilities []string `json:"capabilities,omitempty"`
	// AmbientCapabilities are raised in the ambient set of a task that does
	// not run as root, so that it holds them after exec (they must be in
	// Capabilities). A root task holds its Capabilities without them.
	AmbientCapabilities []string `json:"ambient_capabilities,omitempty"`

	// Isolation, when set, keeps the task from the host: see Isolation.
	// nil gives the task the host's view (a privileged task).
	Isolation *Isolation `json:"isolation,omitempty"`
	// Image, when set, makes an image the task's root in place of
	// Isolation's chroot_env (a task that is not privileged) or of the
	// host's root (a privileged task): see ImageRoot.
	Image *ImageRoot `json:"image,omitempty"`

	// NetNS is the path of the network namespace the task runs in (the
	// group's, that Nomad made); "" keeps the host's network. See netns.go.
	NetNS string `json:"net_ns,omitempty"`

	Mounts []Mount `json:"mounts,omitempty"`
	// LateMounts are mounts that are not ready when Start is called: CSI
	// volumes still being staged. Only their targets count here: the
	// supervisor sets up everything else meanwhile, Start gets the mounts
	// themselves from its late function and hands them over, and only then
	// is the task forked. A Mount whose target lies inside a late mount's
	// target is made after it.
	LateMounts []Mount `json:"late_mounts,omitempty"`

	Limits cgroups.Limits `json:"limits"`
	// CgroupParent is the group all tasks of this driver go under, e.g.
	// "nomad-csi"; the task's group is CgroupParent/CgroupName.
	CgroupParent string `json:"cgroup_parent"`
	// CgroupName names the task's group; it must not contain a slash.
	// Empty means TaskID (which then must not contain one either).
	CgroupName string `json:"cgroup_name,omitempty"`
	// OOMScoreAdj is written to the task's oom_score_adj when non-zero.
	OOMScoreAdj int `json:"oom_score_adj,omitempty"`

	// Supervisor is the binary run as the task's supervisor (and as the
	// exec stage of nomad alloc exec): any program whose main calls
	// supervisor.RunReexec first. Empty means this process's own binary. A small
	// one (driver/executor/shim) starts in a fraction of the time and
	// memory of the whole driver, whose package initialisation is heavy.
	Supervisor string `json:"supervisor,omitempty"`
}

// Credential is a resolved user: uid, primary gid and supplementary gids.
type Credential struct {
	UID    uint32   `json:"uid"`
	GID    uint32   `json:"gid"`
	Groups []uint32 `json:"groups,omitempty"`
}

// ImageRoot is a task's root made of an image: an overlay of the image's
// layers, read-only and shared with every task of the image, under a
// writable layer of the task's own in its state directory (UpperDir and
// WorkDir). A task that is not privileged gets it nosuid and nodev, and its
// /dev, /proc, /sys and /tmp as with chroot_env; a privileged task gets
// the host's /dev, /sys and /proc and, read-only, /lib/modules.
type ImageRoot struct {
	// Layers are the host paths of the image's unpacked layer
	// directories, lowest (the base) first.
	Layers []string `json:"layers"`
	// ReadOnly keeps the root read-only (readonly_rootfs): no writable
	// layer on disk; the mount points the supervisor makes go to a small
	// one in memory, and the root is made read-only before the task runs.
	ReadOnly bool `json:"read_only,omitempty"`
	// Ref and Digest name the image, for messages.
	Ref    string `json:"ref,omitempty"`
	Digest string `json:"digest,omitempty"`
}

// Directories of an image task's writable layer in Spec.StateDir.
const (
	ImageUpperDir = "upper"
	ImageWorkDir  = "work"
)

// Isolation is what keeps a task that is not privileged from the host.
type Isolation struct {
	// ChrootEnv maps host paths to paths in the task's root: the only host
	// files the task sees besides its mounts, bound read-only, nosuid and
	// nodev. A host path that does not exist is left out.
	ChrootEnv map[string]string `json:"chroot_env"`
	// PrivatePID runs the task in a PID namespace of its own, whose init is
	// the task's supervisor, with /proc for that namespace.
	PrivatePID bool `json:"private_pid"`
	// PrivateIPC runs the task in an IPC namespace of its own.
	PrivateIPC bool `json:"private_ipc"`
	// TmpSize, when set, makes the task's /tmp a tmpfs of this many
	// bytes and TmpInodes inodes (the driver's tmp_size and tmp_inodes)
	// rather than Nomad's task tmp/ directory on the allocation's disk.
	TmpSize   int64 `json:"tmp_size,omitempty"`
	TmpInodes int64 `json:"tmp_inodes,omitempty"`
}

// equal reports whether two isolations build the same root.
func (i *Isolation) Equal(o *Isolation) bool {
	if i == nil || o == nil {
		return i == o
	}
	if i.PrivatePID != o.PrivatePID || i.PrivateIPC != o.PrivateIPC || i.TmpSize != o.TmpSize || i.TmpInodes != o.TmpInodes ||
		len(i.ChrootEnv) != len(o.ChrootEnv) {
		return false
	}
	for k, v := range i.ChrootEnv {
		if w, ok := o.ChrootEnv[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// GroupName is the name of the task's control group.
func (s *Spec) GroupName() string {
	if s.CgroupName != "" {
		return s.CgroupName
	}
	return s.TaskID
}

// ExitStatus is how the task ended.
type ExitStatus struct {
	ExitCode  int  `json:"exit_code"`
	Signal    int  `json:"signal"`
	OOMKilled bool `json:"oom_killed"`
	// PidsLimited counts the forks and new threads the task's process
	// limit (pids.max, the driver's pids_limit) refused.
	PidsLimited uint64    `json:"pids_limited,omitempty"`
	Err         string    `json:"err,omitempty"`
	ExitedAt    time.Time `json:"exited_at"`
}
