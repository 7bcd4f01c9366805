#!/usr/bin/env bash
# hclfmt-check.sh NOMAD FILE...: "nomad fmt -check" for job files, the e2e
# job templates included. A template's actions are not HCL, so before it is
# formatted each inline action ({{.JobID}}) becomes an identifier of the
# same length, which keeps the alignment fmt computes, and a line that is
# only an action ({{- if .Vars.User}}) is dropped, as rendering drops it: the
# file is checked as rendered with every condition true. Prints what fmt
# would change.
set -euo pipefail

nomad=$1
shift
rc=0
for f in "$@"; do
	src=$(perl -ne 'next if /^\s*\{\{.*\}\}\s*$/; s/\{\{.*?\}\}/"t" . ("_" x (length($&) - 1))/ge; print' "$f")
	if ! out=$(printf '%s\n' "$src" | "$nomad" fmt - 2>&1); then
		printf '%s: not valid HCL:\n%s\n' "$f" "$out"
		rc=1
		continue
	fi
	if ! d=$(diff -u --label "$f" --label "$f (nomad fmt)" <(printf '%s\n' "$src") <(printf '%s\n' "$out")); then
		printf '%s\n' "$d"
		rc=1
	fi
done
if [ "$rc" -ne 0 ]; then
	echo "nomad fmt wants the changes above (build/nomad fmt FILE applies them to a file that is no template)"
fi
exit "$rc"
