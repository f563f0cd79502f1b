#!/usr/bin/env bash
# Runs the default suite N times in a row (default 5) from a fresh clone of HEAD while a
# second process keeps every core busy, and stops at the first failure. This is how a flaky
# test is caught before CI catches it: `bash tools/soak.sh [N]`.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-5}
repo=$PWD
work=$(mktemp -d /tmp/fedge-soak.XXXXXX)
git clone -q "$repo" "$work/clone"
[ -d "$repo/../shared" ] && ln -s "$(cd "$repo/../shared" && pwd)" "$work/shared"
cores=$(nproc)
# the load: one busy interpreter per core, for as long as the soak runs
pids=()
for _ in $(seq 1 "$cores"); do python3 -c 'while True: pass' & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
echo "soak: $n runs of the default suite in $work/clone under $cores busy loops" >&2
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  (cd "$work/clone" && bash tools/test.sh -q) > "$work/run$i.log" 2>&1
  rc=$?
  echo "soak: run $i/$n exit $rc in $(( $(date +%s) - start )) s: $(tail -n 1 "$work/run$i.log")"
  [ "$rc" -eq 0 ] || { echo "soak: log in $work/run$i.log" >&2; exit "$rc"; }
done
echo "soak: $n of $n runs passed under load"
