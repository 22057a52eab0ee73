#!/usr/bin/env bash
# CI planner tier: every shipped real-model config compiled (deviceless) for its hardware by
# experiments/plan.py, at 2 and 4 layers (train: 8 and 16) extrapolated to the full depth; fails
# when a program's per-device total exceeds 90% of HBM. Needs the AOT toolchain (scripts/setup_aot.sh).
#
#   bash scripts/plan_check.sh                # the CI list
#   bash scripts/plan_check.sh --all          # every config x topology of the README's table
#   bash scripts/plan_check.sh --report-only  # a program that does not fit (plan.py exit 3) is
#                                             # reported, not failed; a compile error still fails
#   OUT=dir bash scripts/plan_check.sh    # where the JSON goes (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.aot/venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
C=experiments/configs
# config|topologies: the README table; each has a record of every program in
# experiments/results/plan_*.json that fits (tests/test_plan.py checks the records).
ALL=(
  "qwen3_8b|8xh100,v5p-16"
  "qwen3_8b_20k|8xh100"
  "qwen3_8b_v6e|v6e-16"
  "qwen3_8b_multihost|32xh100"
  "qwen3_30b_a3b|8xh100,8xh200"
  "qwen3_30b_a3b_multihost|32xh100,v5p-64"
)
# The CI list, longest train compile first (two processes at a time: the 30B node's train takes one
# core while the others follow on the second). qwen3_30b_a3b_multihost's train is extrapolated
# from 4,8 layers in CI (200 s of compile against 392 at 8,16; CI's 45-minute budget): 29.5 GiB
# against 29.6 from 8,16 (plan_qwen3_30b_a3b_multihost_32xh100.json, the record: records stay at
# >= 8 layers, tests/test_plan.py; 2026-12-04 run of this tier), though 4,8 can read low
# (Qwen3-8B: 32.6 against the 36-layer compile's 43.2, plan_depth_check.json), so this is the
# looser check, kept for the config with 2.4x headroom; --all and the other two stay at 8,16
# (62.2 and 42.7 GiB). The tier ran in 12.5 minutes on 2 cores (was ~19).
CI=("qwen3_30b_a3b|8xh100" "qwen3_30b_a3b_multihost|32xh100" "qwen3_8b|8xh100")
declare -A TRAIN_LAYERS_CI=([qwen3_30b_a3b_multihost]=4,8)
LIST=("${CI[@]}")
REPORT_ONLY=0
declare -A TRAIN_LAYERS=()
for k in "${!TRAIN_LAYERS_CI[@]}"; do TRAIN_LAYERS[$k]=${TRAIN_LAYERS_CI[$k]}; done
for arg in "$@"; do
  case "$arg" in
    --all) LIST=("${ALL[@]}"); TRAIN_LAYERS=() ;;
    --report-only) REPORT_ONLY=1 ;;
    *) echo "plan_check: unknown argument $arg" >&2; exit 2 ;;
  esac
done
fail=0
judge() {  # exit status of one plan.py run -> fail or not
  local rc=$1
  if [ "$rc" -eq 3 ] && [ "$REPORT_ONLY" -eq 1 ]; then
    echo "plan_check: a program does not fit (reported only: --report-only)"
  elif [ "$rc" -ne 0 ]; then
    fail=1
  fi
}

# Each config's programs in two processes (train | rollout, eval, gen_rollout), two processes at
# a time (one compile is mostly one core, and this machine has two), the train processes first:
# each takes 2-3x a rollout process, so the short ones fill the second core at the end.
jobs_=()
for part in "train" "rollout,gen_rollout,eval"; do
  for entry in "${LIST[@]}"; do jobs_+=("$entry|$part"); done
done
running=0
runs=()
for job in "${jobs_[@]}"; do
  IFS='|' read -r cfg topo part <<<"$job"
  name="${cfg}_${part%%,*}"
  # Depths to extrapolate from: the train program's per-layer bytes grow with depth (Qwen3-8B,
  # 8xH100: 2,4 -> 36 gives 30.0 GiB, 8,16 -> 36 42.7, the 36-layer compile 43.2;
  # experiments/results/plan_depth_check.json), so train is compiled at 8 and 16 layers; the
  # rollout's and eval's slopes fall with depth, so 2,4 over-estimates them (the safe side).
  layers=$([ "$part" = train ] && echo "${TRAIN_LAYERS[$cfg]:-8,16}" || echo 2,4)
  if [ "$running" -ge 2 ]; then
    rc=0; wait -n || rc=$?; judge $rc; running=$((running - 1))
  fi
  echo "plan_check: $(date +%T) $name (layers $layers)"
  nice -n 5 "$PY" experiments/plan.py --config="$C/$cfg.py" --topology="$topo" --layers="$layers" \
    --programs="$part" --json="$OUT/plan_$name.json" >"$OUT/plan_$name.log" 2>&1 &
  running=$((running + 1))
  runs+=("$name")
done
while [ "$running" -gt 0 ]; do
  rc=0; wait -n || rc=$?; judge $rc; running=$((running - 1))
done
echo "plan_check: $(date +%T) done"
for name in "${runs[@]}"; do
  grep -v "^[WEI][0-9]\{4\}\|^\*\|Very slow\|^$\|^[[:space:]]*$" "$OUT/plan_$name.log" | grep -v "^If you want" || true
done
echo "plan_check: JSON in $OUT"
exit $fail
