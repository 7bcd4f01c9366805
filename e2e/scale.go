//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"strconv"
	"time"
)

// TimeScale stretches the waits of the harness and of the cases that
// assume a fast host: E2E_TIME_SCALE (default 1), which make e2e-vm sets to
// the guest's slowdown, since everything runs several times slower under
// software emulation. Only how long a wait may take grows: what a case
// checks, and the bounds that are the behaviour itself (a kill not before
// kill_timeout), stay as they are.
var TimeScale = timeScaleFromEnv()

func timeScaleFromEnv() float64 {
	s := os.Getenv("E2E_TIME_SCALE")
	if s == "" {
		return 1
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 1 || f > 100 {
		fmt.Fprintf(os.Stderr, "e2e: E2E_TIME_SCALE must be a number from 1 to 100, got %q\n", s)
		os.Exit(2)
	}
	return f
}

// Scaled is d stretched by TimeScale.
func Scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * TimeScale)
}
