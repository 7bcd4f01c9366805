package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

const self = "github.com/nomad-driver-csi/nomad-driver-csi/"

// shimModules are the modules the shim is built from besides the standard
// library and this one: the set it had when the supervisor became a package
// of its own. The shim runs once per task and stays for the task's life, so
// what it links is paid for in start time and memory by every task. A new
// module here is a decision, not an accident: extend the list in the same
// change that explains why.
var shimModules = []string{
	"github.com/cilium/ebpf",           // cgroup v2 device filter (opencontainers/cgroups)
	"github.com/coreos/go-systemd/v22", // opencontainers/cgroups
	"github.com/cyphar/filepath-securejoin",
	"github.com/fatih/color",            // hclog
	"github.com/godbus/dbus/v5",         // opencontainers/cgroups
	"github.com/hashicorp/go-hclog",     // the supervisor's log
	"github.com/mattn/go-colorable",     // hclog
	"github.com/mattn/go-isatty",        // hclog
	"github.com/moby/sys/mountinfo",     // opencontainers/cgroups
	"github.com/moby/sys/userns",        // opencontainers/cgroups
	"github.com/opencontainers/cgroups", // driver/cgroups
	"github.com/sirupsen/logrus",        // opencontainers/cgroups
	"golang.org/x/sys",
}

// shimPackages are the packages of this module the shim may link: the
// supervisor, the contract it shares with the driver, and the leaves
// below them. Never the driver side (driver, driver/executor), which speaks
// Nomad.
var shimPackages = []string{
	"driver/atomicfile",
	"driver/cgroups",
	"driver/executor/shim",
	"driver/executor/supervisor",
	"driver/executor/wire",
	"driver/taskuser", // who a task runs as, resolved as the driver's checks resolve it
	"mounter",
}

// forbidden are modules the shim must never link, whatever the lists above
// say: the Nomad SDK and the RPC stack it brings. A supervisor that needs
// them has stopped being a small program with no RPC to reattach to.
var forbidden = []string{
	"github.com/hashicorp/nomad",
	"github.com/hashicorp/go-plugin",
	"google.golang.org/grpc",
	"google.golang.org/protobuf",
	"github.com/golang/protobuf",
}

// TestShimDependencies guards the shim's dependency set: every package it
// links (go list -deps) is from the standard library, from shimModules, or
// one of shimPackages of this module, and none is from a forbidden module.
func TestShimDependencies(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command to list the shim's dependencies")
	}
	out, err := exec.Command(goBin, "list", "-deps",
		"-f", "{{if not .Standard}}{{.ImportPath}} {{with .Module}}{{.Path}}{{end}}{{end}}",
		self+"driver/executor/shim").CombinedOutput()
	must.NoError(t, err, must.Sprintf("go list: %s", out))

	var pkgs int
	var banned, unlisted []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if line == "" {
			continue
		}
		pkgs++
		pkg, mod, _ := strings.Cut(line, " ")
		for _, f := range forbidden {
			if mod == f || strings.HasPrefix(mod, f+"/") {
				banned = append(banned, pkg)
			}
		}
		if rel, ok := strings.CutPrefix(pkg, self); ok {
			if !slices.Contains(shimPackages, rel) {
				unlisted = append(unlisted, pkg)
			}
		} else if !slices.Contains(shimModules, mod) {
			unlisted = append(unlisted, pkg+" (module "+mod+")")
		}
	}
	must.Positive(t, pkgs)
	must.SliceEmpty(t, banned, must.Sprintf("the shim links the Nomad SDK or an RPC stack (%s): the supervisor must stay without them", first(banned)))
	must.SliceEmpty(t, unlisted, must.Sprintf("the shim links packages beyond its frozen set (%s): keep the supervisor's dependencies small, "+
		"or add the module to shimModules with the reason (packages of this module: only the supervisor side and its leaves)", first(unlisted)))
}

// first names the first few of pkgs, for a failure message.
func first(pkgs []string) string {
	if len(pkgs) > 5 {
		return strings.Join(pkgs[:5], ", ") + ", ..."
	}
	return strings.Join(pkgs, ", ")
}
