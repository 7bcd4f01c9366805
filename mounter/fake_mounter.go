package mounter

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Kinds of FakeAction.
const (
	ActionMount           = "mount"
	ActionBindMount       = "bind"
	ActionRemountReadOnly = "remount-ro"
	ActionUnmount         = "unmount"
	ActionSetPropagation  = "propagation"
	ActionEnsureTarget    = "ensure-target"
	ActionCloneTree       = "clone-tree"
	ActionAttachTree      = "attach-tree"
	ActionLockTree        = "lock-tree"
	ActionUnmountExact    = "unmount-exact"
)

// FakeAction is one call recorded by Fake.
type FakeAction struct {
	Kind   string
	Source string
	Target string
	FSType string
	Flags  uintptr
	// Data is the mount data with sensitive options masked.
	Data      string
	ReadOnly  bool
	Recursive bool
	// Mode is the propagation mode of an ActionSetPropagation.
	Mode  string
	IsDir bool
}

// Fake is an in-memory Interface. It records every call in Actions and
// keeps a mount table in MountPoints (paths are cleaned but symlinks are
// not resolved, and IsMountPoint never reports a missing path). A call whose target has an entry in the matching
// *Errs map fails with that error and changes nothing.
type Fake struct {
	mu sync.Mutex

	MountPoints []MountPoint
	Actions     []FakeAction
	// Targets are the paths EnsureTarget made, mapped to isDir.
	Targets map[string]bool

	MountErrs        map[string]error
	UnmountErrs      map[string]error
	PropagationErrs  map[string]error
	EnsureTargetErrs map[string]error
	RemountErrs      map[string]error
	// CloneErrs fail CloneTree by source (AttachTree fails by target
	// through MountErrs).
	CloneErrs map[string]error
	// IsMountPointErrs fail IsMountPoint by path (fs.ErrNotExist stands
	// for a path that is not there).
	IsMountPointErrs map[string]error
	ListErr          error
	nextID           int
	// stale holds the paths SetStale marked dead; staleHang those whose
	// Stale blocks (SetStaleHang).
	stale     map[string]bool
	staleHang map[string]chan struct{}
	// checks counts the IsMountPoint calls of each path
	// (MountPointChecks).
	checks map[string]int
}

var _ Interface = (*Fake)(nil)

// NewFake returns a Fake holding the given mount table.
func NewFake(mounts ...MountPoint) *Fake {
	f := &Fake{MountPoints: append([]MountPoint(nil), mounts...), Targets: map[string]bool{}, nextID: 1000}
	for _, mp := range mounts {
		if mp.ID >= f.nextID {
			f.nextID = mp.ID + 1
		}
	}
	return f
}

// GetActions returns a copy of the recorded actions.
func (f *Fake) GetActions() []FakeAction {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]FakeAction(nil), f.Actions...)
}

// ResetActions forgets the recorded actions and the counts of
// MountPointChecks.
func (f *Fake) ResetActions() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Actions = nil
	f.checks = nil
}

// MountPointChecks returns how many times IsMountPoint was asked about
// path (cleaned), failed calls included, since the Fake was made or its
// actions reset. A look-up is no action: it is counted here, not in
// Actions.
func (f *Fake) MountPointChecks(path string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.checks[filepath.Clean(path)]
}

func (f *Fake) record(a FakeAction) { f.Actions = append(f.Actions, a) }

func (f *Fake) add(mp MountPoint) {
	if f.nextID == 0 {
		f.nextID = 1000
	}
	mp.ID = f.nextID
	f.nextID++
	f.MountPoints = append(f.MountPoints, mp)
}

func (f *Fake) Mount(source, target, fstype string, flags uintptr, data string) error {
	masked := ""
	if data != "" {
		masked = maskedOption
	}
	return f.mount(source, target, fstype, flags, masked)
}

func (f *Fake) MountSensitive(source, target, fstype string, flags uintptr, options, sensitiveOptions []string) error {
	return f.mount(source, target, fstype, flags, SanitizeOptions(options, sensitiveOptions))
}

func (f *Fake) mount(source, target, fstype string, flags uintptr, logData string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionMount, Source: source, Target: target, FSType: fstype, Flags: flags, Data: logData})
	if err := f.MountErrs[target]; err != nil {
		return err
	}
	f.add(MountPoint{Root: "/", Path: filepath.Clean(target), FSType: fstype, Source: source, Options: []string{"rw"}})
	return nil
}

func (f *Fake) BindMount(source, target string, readOnly, recursive bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionBindMount, Source: source, Target: target, ReadOnly: readOnly, Recursive: recursive})
	if err := f.MountErrs[target]; err != nil {
		return err
	}
	opts := []string{"rw"}
	if readOnly {
		opts = []string{"ro"}
	}
	mp := MountPoint{Root: source, Path: filepath.Clean(target), FSType: "none", Source: source, Options: opts}
	// A bind of a shared mount joins its peer group.
	if src, ok := FindMount(f.MountPoints, filepath.Clean(source)); ok && src.Shared {
		mp.Shared, mp.PeerGroup = true, src.PeerGroup
	}
	f.add(mp)
	return nil
}

func (f *Fake) RemountReadOnly(target string, recursive bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionRemountReadOnly, Target: target, Recursive: recursive})
	if err := f.RemountErrs[target]; err != nil {
		return err
	}
	target = filepath.Clean(target)
	for i := range f.MountPoints {
		mp := &f.MountPoints[i]
		if mp.Path == target || (recursive && PathWithin(mp.Path, target)) {
			mp.Options = replaceOption(mp.Options, "rw", "ro")
		}
	}
	return nil
}

func replaceOption(opts []string, from, to string) []string {
	out := make([]string, 0, len(opts))
	for _, o := range opts {
		if o == from {
			o = to
		}
		out = append(out, o)
	}
	return out
}

func (f *Fake) Unmount(target string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionUnmount, Target: target})
	if err := f.UnmountErrs[target]; err != nil {
		return err
	}
	target = filepath.Clean(target)
	for i := len(f.MountPoints) - 1; i >= 0; i-- {
		if f.MountPoints[i].Path == target {
			f.MountPoints = append(f.MountPoints[:i], f.MountPoints[i+1:]...)
			// A dead mount taken away leaves nothing stale behind.
			delete(f.stale, target)
			return nil
		}
	}
	return nil
}

// UnmountExact removes the topmost mount at path when it is below root and
// has the given ID; otherwise it fails and changes nothing.
func (f *Fake) UnmountExact(root, path string, id int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionUnmountExact, Target: path})
	if err := f.UnmountErrs[path]; err != nil {
		return err
	}
	path = filepath.Clean(path)
	if path == filepath.Clean(root) || !PathWithin(path, root) {
		return fmt.Errorf("fake: %q is not below %q", path, root)
	}
	for i := len(f.MountPoints) - 1; i >= 0; i-- {
		if f.MountPoints[i].Path != path {
			continue
		}
		if f.MountPoints[i].ID != id {
			return fmt.Errorf("fake: %q is no longer the mount point of mount %d (the path now leads to mount %d): left alone", path, id, f.MountPoints[i].ID)
		}
		f.MountPoints = append(f.MountPoints[:i], f.MountPoints[i+1:]...)
		return nil
	}
	return fmt.Errorf("fake: %q is no longer the mount point of mount %d: left alone", path, id)
}

func (f *Fake) SetPropagation(target, mode string, recursive bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionSetPropagation, Target: target, Mode: mode, Recursive: recursive})
	if _, err := PropagationFlags(mode, recursive); err != nil {
		return err
	}
	if err := f.PropagationErrs[target]; err != nil {
		return err
	}
	target = filepath.Clean(target)
	found := false
	for i := range f.MountPoints {
		mp := &f.MountPoints[i]
		if mp.Path != target && !(recursive && PathWithin(mp.Path, target)) {
			continue
		}
		found = found || mp.Path == target
		switch mode {
		case PropagationPrivate:
			mp.Shared, mp.PeerGroup, mp.Slave, mp.Master = false, 0, false, 0
		case PropagationSlave:
			if mp.Shared {
				mp.Slave, mp.Master = true, mp.PeerGroup
			}
			mp.Shared, mp.PeerGroup = false, 0
		case PropagationShared:
			if !mp.Shared {
				mp.Shared, mp.PeerGroup = true, f.nextID
				f.nextID++
			}
		case PropagationUnbindable:
			mp.Shared, mp.PeerGroup, mp.Slave, mp.Master, mp.Unbindable = false, 0, false, 0, true
		}
	}
	if !found {
		return fmt.Errorf("failed to make %q %s: not a mount point", target, mode)
	}
	return nil
}

func (f *Fake) List() ([]MountPoint, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ListErr != nil {
		return nil, f.ListErr
	}
	return append([]MountPoint(nil), f.MountPoints...), nil
}

func (f *Fake) IsMountPoint(path string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path = filepath.Clean(path)
	if f.checks == nil {
		f.checks = map[string]int{}
	}
	f.checks[path]++
	if f.ListErr != nil {
		return false, f.ListErr
	}
	if err := f.IsMountPointErrs[path]; err != nil {
		return false, err
	}
	return isMountPoint(f.MountPoints, path), nil
}

func (f *Fake) EnsureTarget(target string, isDir bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionEnsureTarget, Target: target, IsDir: isDir})
	if err := f.EnsureTargetErrs[target]; err != nil {
		return err
	}
	if f.Targets == nil {
		f.Targets = map[string]bool{}
	}
	f.Targets[filepath.Clean(target)] = isDir
	return nil
}

// fakeTreePrefix names the files Fake.CloneTree returns: the source path
// follows it, for AttachTree to read back.
const fakeTreePrefix = "fake-tree:"

// CloneTree returns an open /dev/null standing for the copy of source.
func (f *Fake) CloneTree(source string, recursive bool) (*os.File, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionCloneTree, Source: source, Recursive: recursive})
	if err := f.CloneErrs[source]; err != nil {
		return nil, err
	}
	fd, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), fakeTreePrefix+filepath.Clean(source)), nil
}

// CloneTreeBeneath is CloneTree, recorded the same way.
func (f *Fake) CloneTreeBeneath(dir, source string, recursive bool) (*os.File, error) {
	return f.CloneTree(source, recursive)
}

// AttachTree mounts the copy as a bind of its source at target.
func (f *Fake) AttachTree(tree *os.File, target string) error {
	source, ok := strings.CutPrefix(tree.Name(), fakeTreePrefix)
	if !ok {
		return fmt.Errorf("fake: %q is not a tree from CloneTree", tree.Name())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.record(FakeAction{Kind: ActionAttachTree, Source: source, Target: target})
	if err := f.MountErrs[target]; err != nil {
		return err
	}
	mp := MountPoint{Root: source, Path: filepath.Clean(target), FSType: "none", Source: source, Options: []string{"rw"}}
	f.add(mp)
	return nil
}

// OpenTarget records an ActionEnsureTarget for the joined path (failing
// like EnsureTarget) and returns an open /dev/null named by it.
func (f *Fake) OpenTarget(root, path string, isDir bool) (*os.File, error) {
	target := filepath.Join(root, path)
	if err := f.EnsureTarget(target, isDir); err != nil {
		return nil, err
	}
	fd, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), target), nil
}

// AttachTreeAt is AttachTree at the target's name.
func (f *Fake) AttachTreeAt(tree, target *os.File) error {
	return f.AttachTree(tree, target.Name())
}

// LockTree records an ActionLockTree with the tree's source, ReadOnly and
// (as Data) "nosuid"/"nodev".
func (f *Fake) LockTree(tree *os.File, readOnly, noSuid, noDev bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	var flags []string
	if noSuid {
		flags = append(flags, "nosuid")
	}
	if noDev {
		flags = append(flags, "nodev")
	}
	source, _ := strings.CutPrefix(tree.Name(), fakeTreePrefix)
	f.record(FakeAction{Kind: ActionLockTree, Source: source, ReadOnly: readOnly, Data: strings.Join(flags, ",")})
	return nil
}

// SetUnmountErr makes Unmount of target fail with err from now on (nil:
// succeed again). Unlike writing UnmountErrs, it is safe while other
// goroutines use the Fake.
func (f *Fake) SetUnmountErr(target string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		delete(f.UnmountErrs, target)
		return
	}
	if f.UnmountErrs == nil {
		f.UnmountErrs = map[string]error{}
	}
	f.UnmountErrs[target] = err
}

// SetIsMountPointErr makes IsMountPoint of path fail with err from now on
// (nil: answer again). Unlike writing IsMountPointErrs, it is safe while
// other goroutines use the Fake.
func (f *Fake) SetIsMountPointErr(path string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path = filepath.Clean(path)
	if err == nil {
		delete(f.IsMountPointErrs, path)
		return
	}
	if f.IsMountPointErrs == nil {
		f.IsMountPointErrs = map[string]error{}
	}
	f.IsMountPointErrs[path] = err
}
