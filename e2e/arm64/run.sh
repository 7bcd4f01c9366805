#!/usr/bin/env bash
# make stage-arm64: the shim's seccomp stage entry point for arm64
# (driver/executor/supervisor/stage_entry_arm64.s) on an arm64 kernel.
# qemu-user, which runs the arm64 cases of TestStageEntry_Root on an amd64
# host, runs no seccomp filter; here every case runs, the filters' too.
#
# The host cross-compiles the shim (as make dist builds it) and the
# supervisor package's test binary for linux/arm64, and packs them with
# Debian's static busybox into an initramfs whose /init runs
# TestStageEntry_Root and powers the guest off. The guest is Debian 12's
# arm64 kernel under qemu-system-aarch64 with software emulation (TCG); no
# disk, no network. The kernel and busybox come from Debian's arm64
# packages, fetched once with apt into a state of their own (the host's
# apt configuration and dpkg's architectures are untouched) and cached
# beside the Nomad agent. The script fails when a case failed or was
# skipped, when the test did not run on an aarch64 kernel, or when the
# guest did not finish within ARM64_TIMEOUT (default 10m); the run
# directory is removed and qemu stopped by PID on every way out, an
# interrupt included.
#
# Environment: ARM64_TIMEOUT bounds the guest's run (a timeout(1)
# duration); ARM64_REFRESH=1 fetches the guest's packages again;
# NOMAD_CACHE is the cache directory (as in the GNUmakefile).
set -euo pipefail

# All of it is one function, read whole before it runs.
main() {
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"

say() { printf '==> %s\n' "$*"; }
die() {
	echo "stage-arm64: $*" >&2
	exit 1
}
elapsed() { awk -v s="$1" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }'; }

for c in qemu-system-aarch64 cpio apt-get dpkg-deb; do
	command -v "$c" >/dev/null || die "$c is missing: run make stage-arm64-deps"
done
timeout=${ARM64_TIMEOUT:-10m}
cache=${NOMAD_CACHE:-$HOME/.cache/nomad-driver-csi}/arm64-guest
# The shim's linker flags, as the GNUmakefile's SHIM_LDFLAGS (TestLDFlags
# checks that they are the same).
ldflags="-s -w -E github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor.stageEntry"

t0=$(date +%s.%N)
# Run directories of runs that were killed outright (no trap ran; their
# qemu died with them, see below): no qemu names them any more.
for d in /tmp/stagearm64-*; do
	[ -d "$d" ] || continue
	pgrep -f -- "$d/" >/dev/null || rm -rf "$d"
done
run_dir=$(mktemp -d /tmp/stagearm64-XXXXXX)
qemu_pid=""
cleanup() {
	local rc=$?
	trap - EXIT INT TERM HUP
	if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
		echo "stage-arm64: stopping the guest (qemu pid $qemu_pid)" >&2
		kill -TERM "$qemu_pid" 2>/dev/null || true
		for _ in $(seq 50); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$qemu_pid" 2>/dev/null || true
		wait "$qemu_pid" 2>/dev/null || true
	fi
	rm -rf "$run_dir"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# 1. The guest's kernel and busybox (cached).
if [ "${ARM64_REFRESH:-}" = 1 ] || [ ! -s "$cache/vmlinuz" ] || [ ! -s "$cache/busybox" ]; then
	say "fetching Debian's arm64 kernel and busybox-static into $cache"
	apt_dir=$run_dir/apt
	mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/deb"
	: >"$apt_dir/status"
	apt_opts=(-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "Dir::State::status=$apt_dir/status"
		-o APT::Architecture=arm64 -o APT::Architectures::=arm64 -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
	apt-get "${apt_opts[@]}" -qq update
	kernel_pkg=$(apt-cache "${apt_opts[@]}" depends linux-image-arm64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
	[ -n "$kernel_pkg" ] || die "no kernel package behind Debian's linux-image-arm64"
	(cd "$apt_dir/deb" && apt-get "${apt_opts[@]}" -qq download "$kernel_pkg" busybox-static)
	mkdir -p "$apt_dir/x"
	dpkg-deb --fsys-tarfile "$apt_dir"/deb/linux-image-*.deb | tar -x -C "$apt_dir/x" --wildcards './boot/vmlinuz-*'
	dpkg-deb --fsys-tarfile "$apt_dir"/deb/busybox-static_*.deb | tar -x -C "$apt_dir/x" ./bin/busybox
	mkdir -p "$cache"
	cp "$apt_dir"/x/boot/vmlinuz-* "$cache/vmlinuz.tmp" && mv "$cache/vmlinuz.tmp" "$cache/vmlinuz"
	cp "$apt_dir/x/bin/busybox" "$cache/busybox.tmp" && mv "$cache/busybox.tmp" "$cache/busybox"
	(cd "$apt_dir/deb" && ls ./*.deb | sed 's|^\./||') >"$cache/packages"
	rm -rf "$apt_dir"
fi
say "guest packages: $(tr '\n' ' ' <"$cache/packages")"

# 2. The shim and the test binary, for linux/arm64.
build_start=$(date +%s.%N)
root=$run_dir/root
mkdir -p "$root"/{bin,usr/bin,dev,proc,sys,tmp}
CGO_ENABLED=0 GOOS=linux GOARCH=arm64 nice -n 10 go build -trimpath -ldflags "$ldflags" -o "$root/shim" ./driver/executor/shim
CGO_ENABLED=0 GOOS=linux GOARCH=arm64 nice -n 10 go test -c -o "$root/stage.test" ./driver/executor/supervisor
say "built the arm64 shim and test binary in $(elapsed "$build_start")s"

# 3. The initramfs: busybox for /init and the test's shell commands.
cp "$cache/busybox" "$root/bin/busybox"
for a in sh mount uname cat poweroff grep tr cut env true; do
	ln -s busybox "$root/bin/$a"
done
cat >"$root/init" <<'EOF'
#!/bin/sh
# PID 1 of the guest: runs the stage's tests, says how they ended, powers
# off (if it exited instead, the kernel would panic and, with panic=-1 and
# qemu's -no-reboot, end the guest all the same).
mount -t proc proc /proc
mount -t devtmpfs dev /dev
mount -t sysfs sys /sys
mount -t tmpfs tmp /tmp
echo "STAGE-ARM64-KERNEL $(uname -s -r -m)"
cd /tmp
SHIMTEST_PREBUILT=/shim TMPDIR=/tmp /stage.test -test.run '^TestStageEntry_Root$' -test.count=1 -test.v -test.timeout 8m
echo "STAGE-ARM64-RESULT rc=$?"
poweroff -f
EOF
chmod 0755 "$root/init" "$root/shim" "$root/stage.test"
(cd "$root" && find . | cpio -o -H newc -R 0:0 --quiet | gzip -1) >"$run_dir/initrd.gz"

# 4. Boot. setpriv: qemu gets SIGKILL if this script is killed outright,
# when no trap runs.
say "booting the arm64 guest (TCG; at most $timeout)"
boot_start=$(date +%s.%N)
console=$run_dir/console.log
nice -n 10 setpriv --pdeathsig KILL qemu-system-aarch64 -M virt -cpu max,pauth-impdef=on -accel tcg,thread=multi \
	-smp 2 -m 1024 -nographic -no-reboot -nic none -kernel "$cache/vmlinuz" -initrd "$run_dir/initrd.gz" \
	-append 'console=ttyAMA0 panic=-1 quiet' </dev/null >"$console" 2>&1 &
qemu_pid=$!
deadline=$(($(date +%s) + $(timeout_seconds "$timeout")))
while kill -0 "$qemu_pid" 2>/dev/null; do
	if [ "$(date +%s)" -ge "$deadline" ]; then
		tail -40 "$console" | tr -d '\r' >&2
		die "the guest did not finish within $timeout"
	fi
	sleep 1
done
wait "$qemu_pid" || true
qemu_pid=""
boot_took=$(elapsed "$boot_start")

# 5. The verdict, from the console.
out=$run_dir/out.log
tr -d '\r' <"$console" >"$out"
sed -n '/^STAGE-ARM64-KERNEL /,/^STAGE-ARM64-RESULT /p' "$out"
result=$(awk '/^STAGE-ARM64-RESULT rc=/ { sub(/.*rc=/, ""); print; exit }' "$out")
if [ -z "$result" ]; then
	tail -40 "$out" >&2
	die "the guest ended without a result (see its console above)"
fi
grep -q '^STAGE-ARM64-KERNEL Linux [^ ]* aarch64$' "$out" || die "the test did not run on an aarch64 kernel"
fails=$(grep -c -- '--- FAIL' "$out" || true)
skips=$(grep -c -- '--- SKIP' "$out" || true)
passes=$(grep -c -- '--- PASS: TestStageEntry_Root/arm64/' "$out" || true)
[ "$result" = 0 ] || die "the test binary exited $result ($fails failed)"
[ "$fails" = 0 ] || die "$fails cases failed"
[ "$skips" = 0 ] || die "$skips cases were skipped: each must run on an arm64 kernel"
grep -q -- '^--- PASS: TestStageEntry_Root ' "$out" || die "TestStageEntry_Root did not pass"
[ "$passes" -gt 0 ] || die "no arm64 case ran"
say "stage-arm64: $passes arm64 cases passed on $(awk '/^STAGE-ARM64-KERNEL / { print $3; exit }' "$out"); guest ${boot_took}s, all $(elapsed "$t0")s"
}

# timeout_seconds turns a timeout(1) duration (10m, 90s, 1h, 300) into
# seconds.
timeout_seconds() {
	local d=$1
	case "$d" in
	*s) echo "${d%s}" ;;
	*m) echo $((${d%m} * 60)) ;;
	*h) echo $((${d%h} * 3600)) ;;
	*) echo "$d" ;;
	esac
}

main "$@"
