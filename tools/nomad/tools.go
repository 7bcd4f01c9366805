//go:build tools

// Package tools records the Nomad agent as a build dependency of this module.
package tools

import _ "github.com/hashicorp/nomad"
