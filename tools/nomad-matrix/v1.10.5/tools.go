//go:build tools

// Package tools records Nomad v1.10.5 as a build dependency of this module, for
// the version matrix (make e2e-matrix).
package tools

import _ "github.com/hashicorp/nomad"
