package supervisor

import "github.com/nomad-driver-csi/nomad-driver-csi/driver/taskuser"

// resolveUser is who the task runs as (taskuser.Resolve, which the driver's
// checks use too).
func resolveUser(spec string) (*taskuser.Credential, error) { return taskuser.Resolve(spec) }
