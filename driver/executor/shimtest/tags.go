//go:build !cgroupv2_nocontrollers

package shimtest

// buildTags are the build tags of the tests that build the shim, which it
// is built with too: see tags_nocontrollers.go.
const buildTags = ""
