package executor

import "github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"

// The driver speaks of tasks in the words of the contract with the
// supervisor (package wire); these names keep its callers to one import.
type (
	Spec       = wire.Spec
	Mount      = wire.Mount
	Isolation  = wire.Isolation
	Credential = wire.Credential
	ImageRoot  = wire.ImageRoot
	ExitStatus = wire.ExitStatus
)

// Propagation modes of a Mount, in Nomad's spelling.
const (
	PropagationPrivate       = wire.PropagationPrivate
	PropagationHostToTask    = wire.PropagationHostToTask
	PropagationBidirectional = wire.PropagationBidirectional
)

var (
	// DefaultCapabilities are kept by a task that is not privileged and
	// that does not set Spec.Capabilities.
	DefaultCapabilities = wire.DefaultCapabilities
	// DefaultChrootEnv is what a task that is not privileged sees of the
	// host when the operator does not set chroot_env.
	DefaultChrootEnv = wire.DefaultChrootEnv
)

// ParseCapabilities is wire.ParseCapabilities.
func ParseCapabilities(names []string) ([]int, error) { return wire.ParseCapabilities(names) }

// KnownCapabilities is wire.KnownCapabilities.
func KnownCapabilities() []string { return wire.KnownCapabilities() }

// ReservedTarget is wire.ReservedTarget.
func ReservedTarget(target string) string { return wire.ReservedTarget(target) }
