package driver

import (
	"errors"
	"fmt"

	"github.com/dustin/go-humanize"
)

// A bounded /tmp (tmp_size, tmp_inodes), off by default.
//
// A task that is not privileged has Nomad's task tmp/ directory at /tmp,
// on the allocation's disk beside /local and /alloc/data: Nomad does not
// enforce ephemeral_disk, so a task can fill that disk's blocks and inodes
// through any of them (see diskfull.go for what the driver does about it).
// With tmp_size set, /tmp is instead a tmpfs of that size and tmp_inodes
// inodes: a task that fills it gets ENOSPC there and nothing else notices;
// its pages count against the task's memory limit, where they would not on
// disk.
//
// It is off by default because it changes what a task's /tmp is: its
// memory, not its allocation's disk, so a task that writes large temporary
// files within its disk allowance would be killed by the OOM killer or run
// out of room; `nomad alloc fs` no longer shows it; and it does not survive
// a restart of the task. It also bounds only /tmp: /local and /alloc/data
// stay on the disk, where a file system of its own for root_dir (and
// Nomad's ephemeral_disk, once enforced) are what protect the node.

// minTmpSize bounds tmp_size from below.
const minTmpSize = 1 << 20

// tmpLimits parses tmp_size and tmp_inodes: the bytes and inodes of a task's
// tmpfs /tmp, 0 and 0 when it is Nomad's directory.
func (c *Config) tmpLimits() (size, inodes int64, err error) {
	if c.TmpInodes < 0 {
		return 0, 0, fmt.Errorf("tmp_inodes must be a positive number of files, got %d", c.TmpInodes)
	}
	if c.TmpSize == "" {
		if c.TmpInodes != 0 {
			return 0, 0, errors.New("tmp_inodes is set but tmp_size is not: set tmp_size (such as \"64MiB\") for a tmpfs /tmp")
		}
		return 0, 0, nil
	}
	n, err := humanize.ParseBytes(c.TmpSize)
	if err != nil || n < minTmpSize || n > 1<<62 {
		return 0, 0, fmt.Errorf("tmp_size must be a size of at least 1MiB such as \"64MiB\", got %q", c.TmpSize)
	}
	size = int64(n)
	inodes = int64(c.TmpInodes)
	if inodes == 0 {
		inodes = max(size/4096, 1024)
	}
	return size, inodes, nil
}
