package supervisor

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shoenig/test/must"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/mounter"
)

// swappedNode is a mounter whose clone of a host device node is, by the
// time it is made, no longer a device: the host's node was replaced
// between buildDev's check and its clone.
type swappedNode struct {
	*mounter.Fake
	file string
}

func (s *swappedNode) CloneTree(source string, recursive bool) (*os.File, error) {
	tree, err := s.Fake.CloneTree(source, recursive)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(s.file)
	if err != nil {
		_ = tree.Close()
		return nil, err
	}
	defer f.Close()
	defer tree.Close()
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), tree.Name()), nil
}

// Every node of a task's /dev is the host's own inode, bound read-only
// whatever the clone turns out to be: one the host swapped for a file
// after buildDev looked is not the task's to write either.
func TestBuildDev_NodesReadOnlyWhateverTheClone(t *testing.T) {
	file := filepath.Join(t.TempDir(), "plain")
	must.NoError(t, os.WriteFile(file, nil, 0o644))
	m := &swappedNode{Fake: mounter.NewFake(), file: file}
	must.NoError(t, buildDev(m, t.TempDir(), true))
	n := 0
	for _, a := range m.Fake.Actions {
		if a.Kind != mounter.ActionLockTree {
			continue
		}
		n++
		must.True(t, a.ReadOnly, must.Sprintf("%s bound writable into the task's /dev", a.Source))
	}
	must.Positive(t, n)
}
