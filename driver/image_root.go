package driver

import (
	"errors"

	"github.com/hashicorp/nomad/plugins/drivers"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
)

// applyImageRoot makes the pulled image the task's root: its layers as
// the read-only lower layers of an overlay, its configuration as the
// defaults of the task's command, environment, working directory and
// user. StartTask calls it after buildSpec for a task with an image.
//
// The task root is built on the imgroot branch; until it lands here a task
// with an image fails rather than run on the host's root.
func (d *Driver) applyImageRoot(conf *Config, cfg *drivers.TaskConfig, tc *TaskConfig, spec *executor.Spec, img *image.Image) error {
	return errors.New("image roots are not supported by this build of the driver yet: remove image from the task, or run a build with image roots")
}
