#!/usr/bin/env bash
# Builds the CSI test binaries into OUTDIR (default: build/csi/ at the repo root):
#
#   csi-fixture      our CSI plugin fixture (e2e/csiplugin, main module)
#   csi-sanity       kubernetes-csi/csi-test v5 conformance suite (e2e/tools/sanity)
#   csi-mock-driver  kubernetes-csi/csi-test v3 mock driver        (e2e/tools/mockdriver)
#   csi-targetshim   makes the target paths a mock plugin does not (e2e/targetshim, main module)
#   csc              dell/gocsi CSI command-line client           (e2e/tools/gocsi)
#   gocsi-mock       dell/gocsi mock plugin                       (e2e/tools/gocsi)
#   netprobe         the network tests' TCP server and client      (e2e/netprobe, main module)
#
# and the CNI reference plugins that Nomad's bridge networking runs (the
# agent's cni_path) into CNIDIR (default: OUTDIR/../cni, i.e. build/cni/):
#
#   bridge firewall host-local loopback portmap   containernetworking/plugins (e2e/tools/cni)
#
# Each third-party tool has its own module because their CSI spec and gRPC
# requirements conflict. A binary is rebuilt only when it is missing or older
# than its module's go.mod/go.sum (or, for the fixture, its sources) or this
# script, so a second run takes well under a second.
#
# Usage: e2e/tools/build.sh [OUTDIR [CNIDIR]]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/build/csi}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cni=${2:-$out/../cni}
mkdir -p "$cni"
cni=$(cd "$cni" && pwd)

# Static binaries: Nomad may run the plugins inside an exec-driver chroot.
export CGO_ENABLED=0

# build NAME DIR PACKAGE INPUT... builds PACKAGE from module DIR into
# OUTDIR/NAME (or NAME itself when it is an absolute path) unless the binary
# is newer than every INPUT (files or dirs).
build() {
	local name=$1 dir=$2 pkg=$3
	shift 3
	local bin=$out/$name
	[[ $name == /* ]] && bin=$name
	if [[ -x $bin && -z $(find "$@" "${BASH_SOURCE[0]}" -newer "$bin" -print -quit) ]]; then
		echo "up to date: $bin"
		return
	fi
	echo "building $bin"
	(cd "$dir" && go build -o "$bin.tmp" "$pkg")
	mv -f "$bin.tmp" "$bin"
}

build csi-fixture "$root" ./e2e/csiplugin "$root/go.mod" "$root/go.sum" "$root/e2e/csiplugin"
build csi-sanity "$here/sanity" github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity "$here/sanity/go.mod" "$here/sanity/go.sum"
build csi-mock-driver "$here/mockdriver" github.com/kubernetes-csi/csi-test/v3/cmd/mock-driver "$here/mockdriver/go.mod" "$here/mockdriver/go.sum"
build csc "$here/gocsi" github.com/dell/gocsi/csc "$here/gocsi/go.mod" "$here/gocsi/go.sum"
build gocsi-mock "$here/gocsi" github.com/dell/gocsi/mock "$here/gocsi/go.mod" "$here/gocsi/go.sum"
build csi-targetshim "$root" ./e2e/targetshim "$root/go.mod" "$root/go.sum" "$root/e2e/targetshim"
build netprobe "$root" ./e2e/netprobe "$root/go.mod" "$root/e2e/netprobe"
for p in main/bridge meta/firewall ipam/host-local main/loopback meta/portmap; do
	build "$cni/${p#*/}" "$here/cni" "github.com/containernetworking/plugins/plugins/$p" "$here/cni/go.mod" "$here/cni/go.sum"
done
