#!/usr/bin/env bash
# The demo behind `make demo`: a Nomad dev agent on 127.0.0.1 with the csi
# driver, the example job run through it, and what happened, printed.
# Everything it starts is stopped and everything it mounts is unmounted on
# the way out, even when a step fails.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
nomad="$repo/build/nomad"
driver="$repo/build/plugins/nomad-driver-csi"
fixture="$repo/build/csi/csi-fixture"
[ -x "$nomad" ] || { echo "build/nomad is missing: run make nomad" >&2; exit 1; }
[ -x "$driver" ] || { echo "build/plugins/nomad-driver-csi is missing: run make dev" >&2; exit 1; }
[ -x "$fixture" ] || { echo "build/csi/csi-fixture is missing: run make csi-tools" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "the demo runs a Nomad client, which needs root" >&2; exit 1; }

work=$(mktemp -d /tmp/ncsi-demo.XXXX)
chmod 755 "$work"
agent_pid=""

say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

cleanup() {
  set +e
  if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
    for j in volume-reader volume-writer hello csi-plugin; do "$nomad" job stop -detach "$j" >/dev/null 2>&1; done
    # A client that shuts down leaves its tasks and their log monitors
    # running, for its restart to find: the jobs' allocations must be done
    # first (30 s at most), and whatever the agent started that outlives it
    # is killed after it.
    for _ in $(seq 1 150); do
      [ "$(live_allocs)" = 0 ] && break
      sleep 0.2
    done
    children=$(ps -o pid= --ppid "$agent_pid")
    kill -INT "$agent_pid"
    for _ in $(seq 1 50); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$agent_pid" 2>/dev/null
    for c in $children; do
      # Only the same process still: one of this demo's binaries.
      case "$(readlink "/proc/$c/exe" 2>/dev/null)" in
      "$nomad" | "$work"/*) kill -KILL "$c" 2>/dev/null ;;
      esac
    done
  fi
  # Unmount whatever was left under the demo's directory, deepest first.
  awk -v w="$work" '$5 ~ "^"w {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT

# live_allocs counts the allocations on the agent that are not done.
live_allocs() {
  "$nomad" operator api /v1/allocations 2>/dev/null |
    python3 -c 'import json, sys; print(sum(a["ClientStatus"] in ("pending", "running") for a in json.load(sys.stdin)))' 2>/dev/null ||
    echo unknown
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
http=$(free_port); rpc=$(free_port); serf=$(free_port)
export NOMAD_ADDR="http://127.0.0.1:$http" NOMAD_CLI_SHOW_HINTS=false

mkdir -p "$work/plugins" "$work/data" "$work/root" "$work/bin"
cp "$driver" "$work/plugins/"
# The plugin binary where an operator installs one: a file root owns and
# only root can write, which the agent's grant names.
install -m 0755 "$fixture" "$work/bin/csi-fixture"
cat >"$work/agent.hcl" <<EOF
disable_update_check = true
ports {
  http = $http
  rpc  = $rpc
  serf = $serf
}
client {
  options {
    "fingerprint.denylist" = "env_aws,env_gce,env_azure,env_digitalocean"
  }
}
plugin "nomad-driver-csi" {
  config {
    allow_privileged = true
    root_dir         = "$work/root"
    # Only the job csi-plugin runs privileged, only this binary, and only
    # it may serve the plugin id "fixture" on this node.
    privileged_grant {
      namespace = "default"
      job       = "csi-plugin"
      command   = "$work/bin/csi-fixture"
      plugin_id = "fixture"
    }
  }
}
EOF

say "Starting a Nomad dev agent on 127.0.0.1:$http with the csi driver"
"$nomad" agent -dev -bind=127.0.0.1 -plugin-dir="$work/plugins" -data-dir="$work/data" \
  -config="$work/agent.hcl" >"$work/agent.log" 2>&1 &
agent_pid=$!

for _ in $(seq 1 100); do
  node=$("$nomad" node status -self -verbose 2>/dev/null || true)
  case "$node" in *driver.csi.version*) break ;; esac
  kill -0 "$agent_pid" 2>/dev/null || { tail -n 30 "$work/agent.log"; exit 1; }
  sleep 0.3
done

say "The node's csi driver"
"$nomad" node status -self -verbose | grep -E '^csi|driver\.csi' || true

# run_batch JOBFILE JOB TASK [nomad job run flags...]: run a batch job, wait
# for it to finish, print its events and logs.
run_batch() {
  local file=$1 job=$2 task=$3; shift 3
  say "nomad job run $file"
  "$nomad" job run -detach "$@" "$repo/$file" >/dev/null
  local alloc=""
  for _ in $(seq 1 150); do
    alloc=$("$nomad" job allocs -t '{{range .}}{{if eq .ClientStatus "complete" "failed"}}{{.ID}}{{end}}{{end}}' "$job" 2>/dev/null || true)
    [ -n "$alloc" ] && break
    sleep 0.2
  done
  [ -n "$alloc" ] || { echo "job $job did not finish in 30s"; "$nomad" job status "$job"; exit 1; }
  "$nomad" alloc status "$alloc" | sed -n '/^Recent Events/,$p'
  echo "--- nomad alloc logs $task:"
  "$nomad" alloc logs "$alloc" "$task"
  local status
  status=$("$nomad" alloc status -t '{{.ClientStatus}}' "$alloc")
  [ "$status" = complete ] || { echo "job $job ended $status"; exit 1; }
}

run_batch examples/jobs/hello.nomad.hcl hello hello

say "Running a CSI plugin as a task: examples/jobs/csi-plugin.nomad.hcl"
"$nomad" job run -detach -var "plugin_command=$work/bin/csi-fixture" \
  -var "plugin_args=[\"--state-dir\",\"$work/plugin-state\"]" "$repo/examples/jobs/csi-plugin.nomad.hcl" >/dev/null
for _ in $(seq 1 150); do
  node=$("$nomad" node status -self -verbose 2>/dev/null || true)
  grep -q 'driver.csi.plugin.fixture.healthy *= true' <<<"$node" && break
  sleep 0.2
done
"$nomad" node status -self -verbose | grep -E 'driver\.csi\.plugin' | sed 's/^/  /'

run_batch examples/jobs/volume-writer.nomad.hcl volume-writer writer
run_batch examples/jobs/volume-reader.nomad.hcl volume-reader reader

say "Mounts under the driver's root once the volume jobs are done (none expected)"
awk -v r="$work/root/mnt/publish" 'index($5, r) == 1 {print "  " $5}' /proc/self/mountinfo
echo "  (end of list)"

say "Done; stopping the jobs and the agent, cleaning up"
