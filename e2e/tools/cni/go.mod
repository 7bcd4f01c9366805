// This module pins the CNI reference plugins (containernetworking/plugins
// v1.7.1) that Nomad's bridge networking runs; e2e/tools/build.sh builds
// bridge, firewall, host-local, loopback and portmap into build/cni/ for the
// network end-to-end tests. A module of its own, apart from the CSI tools.
module github.com/nomad-driver-csi/nomad-driver-csi/e2e/tools/cni

go 1.26

require (
	github.com/alexflint/go-filemutex v1.3.0 // indirect
	github.com/containernetworking/cni v1.3.0 // indirect
	github.com/containernetworking/plugins v1.7.1 // indirect
	github.com/coreos/go-iptables v0.8.0 // indirect
	github.com/godbus/dbus/v5 v5.1.0 // indirect
	github.com/mattn/go-shellwords v1.0.12 // indirect
	github.com/networkplumbing/go-nft v0.4.0 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	github.com/safchain/ethtool v0.5.10 // indirect
	github.com/vishvananda/netlink v1.3.1-0.20250303224720-0e7078ed04c8 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	golang.org/x/sys v0.32.0 // indirect
	sigs.k8s.io/knftables v0.0.18 // indirect
)
