#!/usr/bin/env bash
# CI planner tier: every shipped real-model config compiled (deviceless) for its hardware by
# experiments/plan.py, at 1 and 2 layers extrapolated to the full depth; fails when a program's
# per-device total exceeds 90% of HBM. Needs the AOT toolchain (scripts/setup_aot.sh).
#
#   bash scripts/plan_check.sh            # the CI list (two configs, in parallel on 2 cores)
#   bash scripts/plan_check.sh --all      # every config x topology of the README's table
#   OUT=dir bash scripts/plan_check.sh    # where the JSON goes (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.aot/venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
C=experiments/configs
# config|topologies: the README table (experiments/results/plan_after.json).
ALL=(
  "qwen3_8b|8xh100,v5p-16"
  "qwen3_8b_20k|8xh100"
  "qwen3_8b_multihost|32xh100,v6e-32"
  "qwen3_30b_a3b|8xh200"
  "qwen3_30b_a3b_multihost|32xh100,v5p-64"
)
CI=("qwen3_8b|8xh100" "qwen3_30b_a3b_multihost|32xh100")
if [ "${1:-}" = "--all" ]; then LIST=("${ALL[@]}"); else LIST=("${CI[@]}"); fi

pids=()
for entry in "${LIST[@]}"; do
  cfg=${entry%%|*}
  topo=${entry#*|}
  nice -n 5 "$PY" experiments/plan.py --config="$C/$cfg.py" --topology="$topo" --layers=1,2 \
    --json="$OUT/plan_$cfg.json" >"$OUT/plan_$cfg.log" 2>&1 &
  pids+=($!)
  # two at a time (2 cores)
  if [ ${#pids[@]} -ge 2 ]; then wait "${pids[0]}" || fail=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
for entry in "${LIST[@]}"; do
  cfg=${entry%%|*}
  grep -v "^[WEI][0-9]\{4\}\|^\*\|Very slow\|^$\|^[[:space:]]*$" "$OUT/plan_$cfg.log" | grep -v "^If you want" || true
done
echo "plan_check: JSON in $OUT"
exit ${fail:-0}
