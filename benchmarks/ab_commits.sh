#!/usr/bin/env bash
# Same-run A/B of a benchmark between an older commit and the working tree ("no slowdown" checks).
#
#   [AB_ARGS="--flag ..."] benchmarks/ab_commits.sh <old-commit> [rounds] [bench script, default benchmarks/bench_state.py]
#
# Checks the old commit out into a temporary git worktree and runs the *current* bench script against
# each tree's library (PYTHONPATH), alternating old, new, old, new ... so drift of a shared machine
# falls on both sides. Each run's full output is kept under $AB_OUT (default /tmp/steward-ab); the
# summary table and targets of each run are printed at the end. Runs hold the Spark lock.
set -euo pipefail
old=${1:?usage: ab_commits.sh <old-commit> [rounds] [bench script]}
rounds=${2:-1}
bench=${3:-benchmarks/bench_state.py}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
out=${AB_OUT:-/tmp/steward-ab}
wt=$(mktemp -d /tmp/steward-ab-wt.XXXXXX)
mkdir -p "$out"
git -C "$here" worktree add --detach "$wt" "$old" >/dev/null
trap 'git -C "$here" worktree remove --force "$wt"' EXIT
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    tree=$here; [ "$side" = old ] && tree=$wt
    log=$out/round$r-$side.log
    echo "round $r: $side ($(git -C "$tree" rev-parse --short HEAD)) -> $log"
    PYTHONPATH=$tree/python "$py" -c "import sparksteward, sys; sys.exit(not sparksteward.__file__.startswith('$tree/'))" \
      || { echo "PYTHONPATH=$tree/python does not win over the installed sparksteward" >&2; exit 2; }
    # a bench exits non-zero when one of its targets fails: keep going, the runs are what counts
    # shellcheck disable=SC2086  # AB_ARGS: the bench's own arguments, split on spaces
    (cd "$here" && PYTHONPATH=$tree/python flock /tmp/steward-spark.lock "$py" "$bench" ${AB_ARGS:-}) >"$log" 2>&1 \
      || echo "round $r: $side exited $? (a failed target or an error; see $log)"
  done
done
for log in "$out"/round*-*.log; do
  echo "== $log"
  sed -n '/^engine /,/^bench took/p' "$log"
done
