//go:build tools

// Package tools pins github.com/kubernetes-csi/csi-test/v3 v3.1.1 for the CSI end-to-end tests; e2e/tools/build.sh
// builds its commands into build/csi/.
package tools

import (
	_ "github.com/kubernetes-csi/csi-test/v3/cmd/mock-driver"
)
