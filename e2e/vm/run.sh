#!/usr/bin/env bash
# make e2e-vm (and make e2e-vm-short): the driver on a production-shaped
# host, a Debian 12 guest under qemu with systemd as PID 1, the unified
# cgroup v2 hierarchy with every controller, and / shared.
#
# The host builds everything (the driver, the pinned Nomad agent, the CSI
# tools, and the test binaries with go test -c); the guest image is built
# once by image.sh and cached. The guest boots with software emulation
# (TCG; the host's /dev/kvm is never used), reads the repository over a
# read-only 9p share at the host's own path, runs the steps of the plan
# below, and powers off. Its output is printed here as go test prints it,
# package by package, and this script exits non-zero when a step failed or
# the guest did not finish. The guest's disk is a snapshot of the cached
# image (nothing is written to it), and the run directory is removed and
# qemu stopped by PID on every way out, an interrupt included.
#
# Usage: e2e/vm/run.sh [--short | --old-kernel]
#
#   --short       the cases that need such a host (the cgroup v2 host
#                 tests, the systemd agent restart, shared /), for make
#                 test.
#   --old-kernel  the guest with Debian 11's kernel (5.10, older than the
#                 README's 5.12): the driver must refuse to start tasks and
#                 say why (TestVMOldKernel).
#
# Environment: VM_E2E_RUN overrides the e2e cases (a -test.run regexp);
# VM_TIMEOUT bounds the guest's whole run (default 60m, 15m with --short);
# VM_KERNEL picks the guest's kernel (image.sh); VM_SMP and VM_MEM size the
# guest (2 CPUs, 3072 MiB); E2E_TIME_SCALE overrides the time scale the
# e2e cases get (default 10: the suite runs about 5 times slower in the
# guest than on an idle host, and twice that again while the host is busy).
set -euo pipefail

# All of it is one function, read whole before it runs: a script edited
# while a run reads it goes on with the text it started with.
main() {
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
module=$(awk '/^module / { print $2; exit }' go.mod)

short=""
old=""
case "${1:-}" in
--short) short=1 ;;
--old-kernel)
	short=1
	old=1
	export VM_KERNEL=bullseye
	;;
"") ;;
*) echo "usage: $0 [--short | --old-kernel]" >&2; exit 2 ;;
esac

say() { printf '==> %s\n' "$*"; }
# failures prints, for each test that failed in go test -v output, its
# log entries (its t.Log, t.Error and t.Fatal calls), the last 25 of them,
# each with at most 15 of its further lines (an allocation's events), and
# the agent log tails they carry left out: a failure's message is
# otherwise far up, above the logs its cleanup prints and the output of
# the cases that ran beside it.
failures() {
	awk '
	/^=== (RUN|CONT|NAME|PAUSE) / { cur = $3; keep = 0; next }
	/^ *--- FAIL: / { order[++n] = $3; keep = 0; next }
	/^ +[A-Za-z0-9_.-]+\.go:[0-9]+: / && cur != "" {
		line = $0; sub(/^ +/, "", line)
		if (length(line) > 400) line = substr(line, 1, 400) "..."
		c = ++count[cur]; lines[cur, c] = line
		keep = line ~ /log tail/ ? 0 : 15
		next
	}
	/^        / && cur != "" && keep > 0 {
		line = $0; sub(/^ +/, "", line)
		if (length(line) > 200) line = substr(line, 1, 200) "..."
		lines[cur, count[cur]] = lines[cur, count[cur]] "\n        " line
		keep--
		next
	}
	{ keep = 0 }
	END {
		if (n == 0) exit
		print ""
		print "the failures, in short (each failed test'"'"'s last log entries):"
		for (i = 1; i <= n; i++) {
			t = order[i]; print "--- " t
			from = count[t] > 25 ? count[t] - 24 : 1
			for (j = from; j <= count[t]; j++) print "    " lines[t, j]
		}
	}' "$1"
}
die() {
	echo "e2e-vm: $*" >&2
	exit 1
}

[ "$(id -u)" = 0 ] || die "it needs root (debootstrap, and qemu's shares as root)"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 is missing: run make vm-deps"
for f in build/nomad build/plugins/nomad-driver-csi build/csi/csi-fixture; do
	[ -e "$f" ] || die "$f is missing: run make nomad dev csi-tools"
done

t0=$(date +%s.%N)
elapsed() { awk -v s="$1" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }'; }

# 1. The guest image (cached).
image_start=$(date +%s.%N)
image=$(nice -n 10 e2e/vm/image.sh | tail -1)
image_took=$(elapsed "$image_start")
say "guest image $image (kernel $(cat "$image/kernel")) ready in ${image_took}s"

# 2. The test binaries, compiled here for the guest.
say "building the test binaries into build/vm/"
mkdir -p build/vm
nice -n 10 go test -c -o build/vm/cgroups.test ./driver/cgroups
nice -n 10 go test -c -o build/vm/executor.test ./driver/executor
nice -n 10 go test -c -tags e2e -o build/vm/e2e.test ./e2e
nice -n 10 go build -o build/vm/slowdown ./e2e/vm/slowdown

# 3. The plan: which binaries run in the guest, with which cases.
scale=${E2E_TIME_SCALE:-10}
if [ -n "$short" ]; then
	timeout=${VM_TIMEOUT:-15m}
	# The host tests of the cgroup package on a v2 hierarchy with every
	# controller, and the e2e cases that need what only the guest has:
	# systemd (the agent as a unit, restarted with systemctl), cgroup v2
	# with controllers (limits, OOM, weights, cores, pids, devices,
	# statistics) and / shared; a granted plugin's weight against a job's
	# own plugin block's, as cpu.weight.
	cg_run='^TestHost_'
	# The executor's tests of limits a v2 host with controllers enforces:
	# OOM score and group, OOM kill, pids limit, the device filter.
	ex_run='^(TestStart_OOMScoreAdjAndCgroup_Root|TestStart_OOMKilled_Root|TestStart_PidsLimited_Root|TestIsolation_Devices_Root)$'
	# An image task's root on a distribution's kernel: before Linux 6.5
	# overlay takes its options the legacy way (mounter.MountOverlay).
	e2e_run=${VM_E2E_RUN:-'^(TestVM.*|TestAgentRestartRecoversTask|TestMemoryLimitOOMKilled|TestOOMKilledChildTaskCompletes|TestImageTasks|TestImageTaskSurvivesAgentRestart|TestEscapePluginCPUWeight)$'}
	if [ -n "$old" ]; then
		# The driver starts no task there: only its refusal is tested.
		ex_run='^$'
		e2e_run=${VM_E2E_RUN:-'^TestVMOldKernel$'}
	fi
else
	timeout=${VM_TIMEOUT:-60m}
	cg_run='.'
	ex_run='.'
	# Every case but those that need a Go toolchain or git in the guest
	# (TestDistVersion, TestDriverUpgrade build the driver), the soak and
	# the fault suite (their own targets), and the cases the suite
	# already runs on cgroup v2 with make e2e-cgroup2.
	e2e_run=${VM_E2E_RUN:-'.'}
fi
# Run directories of runs that were killed outright (no trap ran; their
# qemu died with them, see below): no qemu names them any more.
for d in /tmp/e2evm-*; do
	[ -d "$d" ] || continue
	if ! pgrep -f -- "path=$d," >/dev/null; then
		rm -rf "$d"
	fi
done
run_dir=$(mktemp -d /tmp/e2evm-XXXXXX)
qemu_pid=""
tail_pid=""
cleanup() {
	local rc=$?
	trap - EXIT INT TERM HUP
	if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
		echo "e2e-vm: stopping the guest (qemu pid $qemu_pid)" >&2
		kill -TERM "$qemu_pid" 2>/dev/null || true
		for _ in $(seq 50); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$qemu_pid" 2>/dev/null || true
		wait "$qemu_pid" 2>/dev/null || true
	fi
	[ -z "$tail_pid" ] || kill "$tail_pid" 2>/dev/null || true
	rm -rf "$run_dir"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

mkdir -p "$run_dir/out"
cp e2e/vm/guest.sh "$run_dir/guest.sh"
cat >"$run_dir/env" <<EOF
VM_REPO=$repo
VM_MODULE=$module
EOF
{
	# E2E_SYSTEMD: every Persistent agent's client is a systemd unit.
	echo "export E2E_SKIP_BUILD=1 E2E_KEEP=1 E2E_TIME_SCALE=$scale E2E_VM=${old:+old-kernel}${old:-1} E2E_SYSTEMD=1"
	# The guest's slowdown against this host, printed at the end: what
	# the run's timings mean.
	echo "slowdown"
	[ -n "$old" ] || echo "step driver/cgroups $timeout build/vm/cgroups.test -test.run '$cg_run'"
	[ "$ex_run" = '^$' ] || echo "step driver/executor $timeout build/vm/executor.test -test.run '$ex_run'"
	# TestVMOldKernel runs only on the old kernel (--old-kernel).
	e2e_skip='^(TestDistVersion|TestDriverUpgrade|TestSoak|TestSoakSlope|TestFaults|TestVMOldKernel)$'
	[ -z "$old" ] || e2e_skip='^$'
	echo "step e2e $timeout build/vm/e2e.test -test.run '$e2e_run' -test.skip '$e2e_skip'"
} >"$run_dir/plan.sh"

# The slowdown probe on this host, for the ratios (the guest runs it too).
nice -n 10 build/vm/slowdown >"$run_dir/slowdown.host"

# 4. Boot. The guest's disk is a snapshot: qemu keeps its writes in a
# temporary file it has already unlinked.
smp=${VM_SMP:-2}
mem=${VM_MEM:-3072}
say "booting the guest (TCG, $smp CPUs, $mem MiB; the guest's own output is in its console log)"
boot_start=$(date +%s.%N)
# setpriv: qemu gets SIGKILL if this script is killed outright, when no
# trap runs.
TMPDIR=$run_dir nice -n 10 setpriv --pdeathsig KILL qemu-system-x86_64 \
	-accel tcg,thread=multi -cpu max,-erms,-fsrm -smp "$smp" -m "$mem" \
	-display none -monitor none -no-reboot -serial "file:$run_dir/console.log" \
	-kernel "$image/vmlinuz" -initrd "$image/initrd.img" \
	-append "console=ttyS0 root=/dev/vda rw panic=-1 quiet mitigations=off" \
	-drive "file=$image/disk.img,format=raw,if=virtio,cache=unsafe,snapshot=on" \
	-virtfs "local,path=$run_dir,mount_tag=ncsi-run,security_model=none,id=ncsi-run" \
	-virtfs "local,path=$repo,mount_tag=ncsi-src,security_model=none,readonly=on,id=ncsi-src" \
	-nic none &
qemu_pid=$!

# Print the guest's test output as it grows, until qemu exits or the time
# is up.
touch "$run_dir/out/go-test.log"
tail -n +1 -F "$run_dir/out/go-test.log" 2>/dev/null &
tail_pid=$!
limit=$(awk -v t="$timeout" 'BEGIN { n = t + 0; u = substr(t, length(t)); if (u == "m") n *= 60; else if (u == "h") n *= 3600; print int(n) + 300 }')
ready_took=""
while kill -0 "$qemu_pid" 2>/dev/null; do
	if [ -z "$ready_took" ] && [ -s "$run_dir/out/ready" ]; then
		ready_took=$(elapsed "$boot_start")
	fi
	if [ "$(elapsed "$boot_start" | cut -d. -f1)" -gt "$limit" ]; then
		echo "e2e-vm: the guest did not finish within ${limit}s; stopping it" >&2
		break
	fi
	sleep 1
done
if kill -0 "$qemu_pid" 2>/dev/null; then
	kill -TERM "$qemu_pid" 2>/dev/null || true
fi
wait "$qemu_pid" 2>/dev/null || true
qemu_pid=""
sleep 1
kill "$tail_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true
tail_pid=""
guest_took=$(elapsed "$boot_start")

if [ -s "$run_dir/slowdown.host" ] && [ -s "$run_dir/out/slowdown.guest" ]; then
	echo
	echo "guest slowdown (the same program, guest time / host time; host load: $(cut -d' ' -f1-3 /proc/loadavg)):"
	awk 'NR == FNR { host[$1] = $2; next } ($1 in host) && host[$1] > 0 {
		printf "  %-24s host %10.1f us  guest %10.1f us  %6.1fx\n", $1, host[$1] / 1000, $2 / 1000, $2 / host[$1] }' \
		"$run_dir/slowdown.host" "$run_dir/out/slowdown.guest"
fi
# The agents' logs, for a failure's whole story.
rm -rf build/vm/logs
if [ -d "$run_dir/out/logs" ]; then
	cp -r "$run_dir/out/logs" build/vm/logs
	echo "e2e-vm: the guest's agent logs are in build/vm/logs/"
fi
echo
echo "e2e-vm: image ${image_took}s, boot to ready ${ready_took:-?}s (guest kernel says $(cut -d' ' -f2 "$run_dir/out/ready" 2>/dev/null || echo ?)s), guest run ${guest_took}s, all $(elapsed "$t0")s"
status=$(cat "$run_dir/out/status" 2>/dev/null || true)
if [ -z "$status" ]; then
	echo "e2e-vm: the guest did not finish its run; the last lines of its console:" >&2
	tail -40 "$run_dir/console.log" >&2 || true
	exit 1
fi
if [ "$status" != 0 ]; then
	failures "$run_dir/out/go-test.log" >&2
	echo "FAIL: the guest's tests failed (see above)" >&2
	exit 1
fi
}

main "$@"
