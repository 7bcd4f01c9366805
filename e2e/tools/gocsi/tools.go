//go:build tools

// Package tools pins github.com/dell/gocsi v1.17.0 for the CSI end-to-end tests; e2e/tools/build.sh
// builds its commands into build/csi/.
package tools

import (
	_ "github.com/dell/gocsi/csc"
	_ "github.com/dell/gocsi/mock"
)
