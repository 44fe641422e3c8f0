#!/usr/bin/env bash
# Issue 25, item 6: CI (`bash .ci/run`, which is the README's `make test`, then the torch 2.15
# build) on a fresh clone, as a new user would run it, with or without load beside it.
#
# usage: benchmarks/ci/fresh_clone.sh COMMIT quiet|loaded NAME
#
# A clean clone of this checkout at COMMIT with a copy of ../shared beside it, in a venv of
# its own (--system-site-packages: the installed torch; fastddp goes into the venv), timed.
# "loaded": two `python3 -c "while True: pass"` started before and killed by their ids after,
# so both cores of the 2-core CI machine stay busy for the whole run.
# The log is kept as $PROOF/logs/NAME.ci.log and the clone deleted (a clone with its venvs
# takes 2-4.5 GB: kept clones once filled the disk); a summary of each run (exit status, wall
# time, every summary line) is appended to $PROOF/summary.txt. PROOF defaults to /tmp/fastddp-proof.
set -u
commit=$1; mode=$2; name=$3
here=$(cd "$(dirname "$0")/../.." && pwd)
proof=${PROOF:-/tmp/fastddp-proof}
root=$proof/$name
rm -rf "$root"; mkdir -p "$root" "$proof/logs"
git clone -q "$here" "$root/main" && git -C "$root/main" checkout -q "$commit" || exit 1
cp -r "$here/../shared" "$root/shared"
python3 -m venv --system-site-packages "$root/venv" || exit 1
export PATH="$root/venv/bin:$PATH" VIRTUAL_ENV="$root/venv"
pids=()
if [ "$mode" = loaded ]; then
  for _ in 1 2; do python3 -c "while True: pass" & pids+=($!); done
fi
echo "[fresh_clone] $name $commit $mode start $(date -Is) busy: ${pids[*]:-none}" \
  "load: $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
(cd "$root/main" && bash .ci/run) > "$root/ci.log" 2>&1
rc=$?
wall=$(($(date +%s) - start))
for p in "${pids[@]}"; do kill "$p"; done
cp "$root/ci.log" "$proof/logs/$name.ci.log"
{
  echo "== $name $commit $mode rc=$rc wall=$((wall / 60))m$((wall % 60))s start=$(date -Is -d @"$start")"
  grep -E "tests passed|tests failed|[0-9]+ (passed|failed)|^FAILED|^ERROR" "$root/ci.log" | tail -n 30
} >> "$proof/summary.txt"
echo "[fresh_clone] $name done rc=$rc wall=${wall}s"
rm -rf "$root"
exit "$rc"
