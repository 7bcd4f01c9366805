#!/usr/bin/env bash
# fuzz.sh FUZZTIME MINIMIZETIME PKG:TARGET...: runs each Go fuzz target for
# FUZZTIME. A run that fails only with a bare "context deadline exceeded"
# and wrote no failing input hit a race in Go's fuzz coordinator at the end
# of a timed run (golang/go#75804, fixed in Go 1.27, not in 1.26): the
# target found nothing. That run is repeated, at most twice; a failing input,
# any other failure, or the race three times in a row fails.
set -uo pipefail

fuzztime=$1
minimize=$2
shift 2
for t in "$@"; do
	pkg=${t%%:*}
	name=${t##*:}
	for attempt in 1 2 3; do
		echo "==> $name ($pkg, $fuzztime)"
		out=$(mktemp)
		go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" -fuzzminimizetime "$minimize" "$pkg" 2>&1 | tee "$out"
		rc=${PIPESTATUS[0]}
		if [ "$rc" -eq 0 ]; then
			rm -f "$out"
			break
		fi
		if grep -q "^--- FAIL: ${name} " "$out" &&
			grep -qx '    context deadline exceeded' "$out" &&
			! grep -q 'Failing input written to' "$out" &&
			[ "$attempt" -lt 3 ]; then
			echo "==> $name: the fuzz coordinator's end-of-run race (golang/go#75804), no failing input; running it again"
			rm -f "$out"
			continue
		fi
		rm -f "$out"
		exit "$rc"
	done
done
