#!/usr/bin/env bash
# Runs inside the guest (ncsi-guest.service, as root, systemd as PID 1),
# from the run directory the host shares at /run/ncsi: mounts the
# repository the host shares (read-only, at the host's own path), prints
# what the guest is, and runs the steps of plan.sh, each a test binary the
# host compiled with go test -c, in its package directory as go test
# would. Every step's output goes to out/go-test.log, which the host prints
# as it grows, followed by go test's own closing line for the package
# ("ok" or "FAIL", with the time). out/status is the exit status: 0 when
# every step passed.
set -uo pipefail

run=/run/ncsi
out=$run/out
# shellcheck source=/dev/null
. "$run/env"
log=$out/go-test.log
: >"$log"

awk '{ print "ready", $1 }' /proc/uptime >"$out/ready"

mkdir -p "$VM_REPO"
# cache=loose: the share is read-only and nothing changes it during the
# run, so the guest's page cache may keep what it read (without it every
# exec of the 148 MB agent reads it over 9p again).
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,ro,cache=loose ncsi-src "$VM_REPO"; then
	echo "guest: the host shared no repository (ncsi-src)" >>"$log"
	echo 1 >"$out/status"
	exit 1
fi

{
	echo "guest: kernel $(uname -r), $(systemctl --version | head -1), $(nproc) CPUs, $(awk '/MemTotal/ { print int($2 / 1024) " MiB" }' /proc/meminfo)"
	echo "guest: /sys/fs/cgroup is $(stat -f -c %T /sys/fs/cgroup), controllers: $(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null)"
	echo "guest: / is $(findmnt -no PROPAGATION /), PID 1 is $(cat /proc/1/comm), booted in $(cut -d' ' -f2 "$out/ready")s"
} >>"$log"

status=0
# step PKG TIMEOUT BIN ARGS...: runs $VM_REPO/BIN in $VM_REPO/PKG with
# -test.v and -test.timeout TIMEOUT, as "go test -v" would, and writes go
# test's closing line for the package.
step() {
	local pkg=$1 timeout=$2 bin=$3
	shift 3
	local start rc
	start=$(date +%s.%N)
	echo "=== guest: $pkg ($bin $*)" >>"$log"
	(cd "$VM_REPO/$pkg" && "$VM_REPO/$bin" -test.v -test.count=1 -test.timeout "$timeout" "$@") >>"$log" 2>&1
	rc=$?
	local took
	took=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.3fs", e - s }')
	if [ "$rc" = 0 ]; then
		printf 'ok  \t%s/%s\t%s\n' "$VM_MODULE" "$pkg" "$took" >>"$log"
	else
		printf 'FAIL\t%s/%s\t%s\n' "$VM_MODULE" "$pkg" "$took" >>"$log"
		status=1
	fi
}

# slowdown NAME: runs the slowdown probe; the host prints its ratios.
slowdown() {
	"$VM_REPO/build/vm/slowdown" >"$out/slowdown.guest" 2>>"$log" || {
		echo "guest: the slowdown probe failed" >>"$log"
		status=1
	}
}

# shellcheck source=/dev/null
. "$run/plan.sh"

# The agents' logs (E2E_KEEP keeps their directories; the guest's disk is
# thrown away anyway) go back to the host, for a failure's whole story.
for d in /tmp/ncsi-*/; do
	[ -d "$d" ] || continue
	mkdir -p "$out/logs/$(basename "$d")"
	cp "$d"/*.log "$d"/*.hcl "$out/logs/$(basename "$d")/" 2>/dev/null || true
done

# What the tests left: mounts under /tmp and cgroups of the test agents.
{
	left=$(awk '$5 ~ /^\/tmp\// { print $5 }' /proc/self/mountinfo)
	[ -z "$left" ] || { echo "guest: mounts left under /tmp:"; echo "$left"; }
} >>"$log"
echo "$status" >"$out/status"
