#!/usr/bin/env bash
# make e2e-cgroup2: the cgroup tests, the executor's root tests and a subset
# of the end-to-end tests against the real cgroup v2 (unified) hierarchy.
#
# On a host whose /sys/fs/cgroup is already cgroup v2, everything runs as
# is. On a hybrid host (v1 controllers under /sys/fs/cgroup/<controller>,
# cgroup2 at /sys/fs/cgroup/unified) the script re-runs itself in a private
# mount namespace (unshare -m --propagation private) where /sys/fs/cgroup
# is that same unified hierarchy: the namespace's copies of the v1 mounts
# and of the tmpfs holding them are unmounted (the host's stay mounted; a
# v1 hierarchy is released only when its last mount in every namespace is
# gone and it has no child groups, and the host's mounts are untouched), and
# cgroup2 is mounted in their place, so Nomad, the driver and its
# supervisors all see a v2 host. No v1 hierarchy is unmounted on the host
# and no controller is moved to v2: the v1 cpu and memory hierarchies hold
# groups of other users of the machine (the process manager's among them).
#
# When the unified hierarchy offers cpu and memory, the driver is built as
# shipped and every test runs. When it does not (a hybrid host), the driver
# and the tests are built with the tag cgroupv2_nocontrollers
# (driver/cgroups/nocontrollers.go): groups, CLONE_INTO_CGROUP, cgroup.kill,
# freezing and the BPF device filter are real, memory and CPU limits, memory
# usage and OOM detection are skipped, and the tests of those are skipped
# too (they are named at the end).
#
# With --short (make unit-cgroup2, part of make test) it runs the cgroup and
# executor tests only (about 40 seconds once built), on a hybrid host only,
# and skips, successfully, elsewhere: not root, no cgroup v2 hierarchy, or
# a v2 host, where make unit runs them on v2 already.
#
# Environment: E2E_CGROUP2_RUN overrides the e2e tests run (a -run regexp);
# E2E_TIMEOUT bounds the e2e step (default 15m).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"

say() { printf '\n==> %s\n' "$*"; }
fs_type() { stat -f -c %T "$1" 2>/dev/null || true; }

short=""
[ "${1:-}" != --short ] || { short=1; shift; }
# cannot WHY: fails, or with --short skips, saying why.
cannot() {
  if [ -n "$short" ]; then
    echo "skipping the cgroup v2 tests: $*"
    exit 0
  fi
  echo "e2e-cgroup2: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || cannot "they need root (cgroups, mount namespaces, a Nomad client)"
[ -n "$short" ] || [ -x build/nomad ] || cannot "build/nomad is missing: run make nomad"

if [ "${1:-}" != "--inside" ]; then
  case "$(fs_type /sys/fs/cgroup)" in
  cgroup2fs)
    [ -z "$short" ] || cannot "/sys/fs/cgroup is cgroup v2 already, where make unit runs them"
    exec "$0" --inside
    ;;
  *)
    [ "$(fs_type /sys/fs/cgroup/unified)" = cgroup2fs ] ||
      cannot "no cgroup v2 hierarchy here: /sys/fs/cgroup is not cgroup2 and nothing is mounted at /sys/fs/cgroup/unified"
    say "hybrid host: running in a private mount namespace where /sys/fs/cgroup is the unified hierarchy"
    exec unshare -m --propagation private -- "$0" ${short:+--short} --inside --hybrid
    ;;
  esac
fi

if [ "${2:-}" = --hybrid ]; then
  # Only this namespace's copies are unmounted (propagation is private).
  umount -R /sys/fs/cgroup
  # No mount options: they would apply to the whole hierarchy, the host's
  # /sys/fs/cgroup/unified included.
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
fi
[ "$(fs_type /sys/fs/cgroup)" = cgroup2fs ] || { echo "/sys/fs/cgroup is not cgroup2 in the test namespace" >&2; exit 1; }
if grep -q ' /sys/fs/cgroup/' /proc/self/mountinfo; then
  echo "v1 hierarchies are still mounted under /sys/fs/cgroup in the test namespace" >&2
  exit 1
fi

# Nomad makes nomad.slice and the driver its default parent nomad-csi at
# the root of the hierarchy, which on a hybrid host is the host's
# /sys/fs/cgroup/unified: remove them on the way out when this run made
# them and they are empty (rmdir never removes a group in use).
made_here=()
for g in nomad.slice nomad-csi; do
  [ -e "/sys/fs/cgroup/$g" ] || made_here+=("/sys/fs/cgroup/$g")
done
cleanup() {
  local g
  for g in "${made_here[@]}"; do
    [ ! -d "$g" ] || rmdir "$g" 2>/dev/null || echo "left $g in place: it is not empty" >&2
  done
}
trap cleanup EXIT

have=$(cat /sys/fs/cgroup/cgroup.controllers)
say "cgroup v2 controllers available: ${have:-none}"
held=$(awk 'NR > 1 && $2 != 0 {printf "%s ", $1}' /proc/cgroups)
[ -z "$held" ] || echo "    held by v1 hierarchies: $held"

tags=""
skip_cgroups='^$'
skip_executor='^$'
skip_e2e='^$'
if ! { grep -qw cpu <<<"$have" && grep -qw memory <<<"$have"; }; then
  tags=cgroupv2_nocontrollers
  # The tests of limits, memory usage and OOM kills, which need the
  # memory and cpu controllers. The executor's OOM test would grow its
  # task without bound, so it must not run; its process limit test needs
  # the pids controller.
  skip_executor='^(TestStart_OOMKilled_Root|TestStart_PidsLimited_Root)$'
  skip_e2e='^TestMemoryLimitOOMKilled$'
  say "no cpu/memory controllers: building with -tags $tags (limits, memory usage and OOM detection skipped)"
fi

out=build/cgroup2
mkdir -p "$out/plugins"
if [ -z "$short" ]; then
  say "building the driver and its supervisor shim into $out"
  # With the seccomp stage's entry point, as make dev builds it.
  CGO_ENABLED=0 go build -tags "$tags" -trimpath -ldflags "-s -w -E github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/supervisor.stageEntry" -o "$out/nomad-driver-csi-shim" ./driver/executor/shim
  # The driver embeds driver/shimbin/nomad-driver-csi-shim; the overlay makes
  # it embed this build's shim without touching the source tree.
  printf '{"Replace":{"%s":"%s"}}\n' "$repo/driver/shimbin/nomad-driver-csi-shim" "$repo/$out/nomad-driver-csi-shim" >"$out/overlay.json"
  go build -tags "$tags" -overlay "$out/overlay.json" -o "$out/plugins/nomad-driver-csi" .
  e2e/tools/build.sh build/csi >/dev/null
fi

failed=""
# step NAME CMD...: runs CMD with its output in $out/NAME.log, prints the
# test results, and records a failure.
step() {
  local name=$1
  shift
  say "$name"
  if "$@" >"$out/$name.log" 2>&1; then
    grep -E '^ *(--- (FAIL|SKIP)|ok |FAIL)|ESCAPED' "$out/$name.log" || true
    grep -cE '^ *--- PASS' "$out/$name.log" | sed 's/^/    passed (tests and subtests): /'
  else
    grep -E '^ *(--- (FAIL|SKIP)|ok |FAIL|panic)|ESCAPED' "$out/$name.log" || tail -30 "$out/$name.log"
    echo "    FAILED: see $out/$name.log"
    failed="$failed $name"
  fi
}

# The fake-tree tests check the shipped build, so a tagged build runs only
# the host tests.
cg_run=.
[ -z "$tags" ] || cg_run='^TestHost_'
step cgroups go test -tags "$tags" -count=1 -v -run "$cg_run" -skip "$skip_cgroups" ./driver/cgroups/
step executor go test -tags "$tags" -count=1 -v -skip "$skip_executor" ./driver/executor/

# Lifecycle (start, logs, exit codes, stop signals, alloc exec, recovery
# after an agent restart, bad configs), isolation (the escape suite), a
# volume staged and published through a CSI plugin task (TestVolumes).
[ -n "$short" ] || {
  e2e_run=${E2E_CGROUP2_RUN:-'^(TestFingerprint|TestBatchLogsAndExitCode|TestStopSignal|TestAgentRestartRecoversTask|TestAllocExec|TestBadTaskConfig|TestMemoryLimitOOMKilled|TestEscape|TestVolumes)$'}
  E2E_SKIP_BUILD=1 E2E_PLUGIN_DIR="$repo/$out/plugins" \
    step e2e go test -tags e2e -count=1 -timeout "${E2E_TIMEOUT:-15m}" -v -run "$e2e_run" -skip "$skip_e2e" ./e2e/
}

if [ -n "$failed" ]; then
  say "cgroup v2 run FAILED:$failed"
  exit 1
fi
say "cgroup v2 run passed (controllers: ${have:-none}${tags:+; skipped for want of controllers: TestHost_OOM TestHost_Cpuset TestHost_StatsBusy TestHost_Recreate TestHost_CreateUndo $skip_executor $skip_e2e})"
