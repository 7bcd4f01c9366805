#!/usr/bin/env bash
# Runs the core e2e cases against each Nomad agent of the version matrix and
# prints one table: make e2e-matrix. Each agent is build/nomad-matrix/nomad-VERSION
# (make nomad-matrix); the cases reach it through E2E_NOMAD_BIN. The
# versions run one after another (the cases use loop devices and cgroups of
# this host), each with its log in build/nomad-matrix/VERSION.log.
#
#   e2e/matrix/run.sh v1.11.3 v1.10.5 v1.9.7
#
# Environment: E2E_MATRIX_TIMEOUT (go test -timeout per version, 15m),
# MATRIX_COMMAND (the command named under the table).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$repo/build/nomad-matrix
table=$out/matrix.md

# The core cases: the driver loads, task lifecycle (exit codes, stop
# signals), an agent restart recovers a task, a CSI plugin as a task, a
# driver-managed volume, a native (Nomad-scheduled) volume, and the cluster
# case (a plugin system job on three clients, volumes placed by
# constraint), and the harness's allocation waits on the version's event
# stream. A subtest
# pattern applies to every test that has subtests.
cases=(
  "agent is this version|TestNomadVersion"
  "driver loads|TestFingerprint"
  "lifecycle|TestBatchLogsAndExitCode TestStopSignal"
  "agent restart|TestAgentRestartRecoversTask"
  "plugin task|TestCSIPluginTasks"
  "driver-managed volume|TestVolumes"
  "native volume|TestNativeCSI"
  "cluster, 3 clients|TestCluster"
  "event stream|TestAllocWaitFollowsEventStream"
)
top='^(TestNomadVersion|TestFingerprint|TestBatchLogsAndExitCode|TestStopSignal|TestAgentRestartRecoversTask|TestCSIPluginTasks|TestVolumes|TestNativeCSI|TestCluster|TestAllocWaitFollowsEventStream)$'
sub='^(exit_.*|trapped|ignored|example_job_serves_plugin|persist|monolith_plugin_healthy|volume_write_read_release|teardown_leaves_nothing|clients_distinct|plugin_on_every_client|volumes_spread_by_constraint)$'

[ $# -gt 0 ] || { echo "usage: $0 VERSION..." >&2; exit 2; }

header="| Nomad |"
rule="| --- |"
for c in "${cases[@]}"; do header="$header ${c%%|*} |"; rule="$rule --- |"; done
rows=()
failed=""
for v in "$@"; do
  bin=$out/nomad-$v
  [ -x "$bin" ] || { echo "no $bin: run make nomad-matrix" >&2; exit 1; }
  log=$out/$v.log
  echo "==> Nomad $v ($("$bin" version | head -1)): log in $log"
  if E2E_NOMAD_BIN=$bin E2E_NOMAD_VERSION=$v E2E_SKIP_BUILD=1 go test -tags e2e -count=1 \
    -timeout "${E2E_MATRIX_TIMEOUT:-15m}" -v -run "$top/$sub" "$repo/e2e/" >"$log" 2>&1; then
    :
  else
    failed="$failed $v"
  fi
  grep -E '^(--- (FAIL|SKIP)|ok |FAIL|panic)' "$log" || true
  row="| $v |"
  for c in "${cases[@]}"; do
    res=pass
    for t in ${c#*|}; do
      if grep -qE "^--- FAIL: $t " "$log"; then res=FAIL
      elif ! grep -qE "^--- PASS: $t " "$log" && [ "$res" = pass ]; then res="not run"
      fi
    done
    row="$row $res |"
  done
  rows+=("$row")
done

{
  echo "$header"
  echo "$rule"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Produced by \`${MATRIX_COMMAND:-e2e/matrix/run.sh $*}\` on $(date -u +%Y-%m-%d), driver $(git -C "$repo" rev-parse --short HEAD)."
} >"$table"
cat "$table"
[ -z "$failed" ] || { echo "matrix FAILED for:$failed (logs in $out)"; exit 1; }
