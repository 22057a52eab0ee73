#!/usr/bin/env bash
# One short check of the kernels and the rollout on a lent Hopper GPU (H100/H200), issue 11 item 5.
#
#   bash scripts/gpu_check.sh            # on the GPU machine (~14 minutes on one H200:
#                                        #   split it with GPU_CHECK_STAGES, below)
#   bash scripts/gpu_check.sh --quick    # anywhere: every stage in its tiny CPU mode
#
# Stages, in order, each under its own time budget (clipped to what is left of the global one;
# a failed or timed-out stage is recorded and the next one runs):
#   env      nvidia-smi, jax/jaxlib/plugin versions, device kind, git sha  -> env.json
#   pytest   pytest -m gpu over the test files that hold gpu-marked tests: every kernel against its
#            reference natively on the device, at real shapes (kernels_pallas/*/test_*.py)
#   matmul   experiments/bench_matmul.py: fp8_matmul (Pallas kernel and XLA fallback) vs BF16
#            jnp.dot, DeepSeek-V3 / Qwen3-8B layers, M in {4096, 16, 64, 8192}; at M 16 and 64
#            also each GEMM with its residual-add consumer (the rollout program's form); the
#            tiles before the latest defaults (:plain) beside them: at prefill M before
#            promotions ran under the wgmmas (the model: 1.06-1.47x), at decode M one 128-K
#            slice per pipeline step instead of two (H200 1.00-1.33x); the first run measured
#            the :plain tiles. At decode M also the default launched plainly (:nopdl; the
#            default launches dependent, MgpuConfig.pdl): compare their "wall us" (the wall
#            clock per GEMM of a chain of them), for CUPTI's kernel time leaves out the gap
#            between kernels that dependent launch shortens (the model: 2.0 -> 0.5 us a GEMM).
#            At M 16 (and at 32 / 64 where the model picks it: tile_choice.fused_wins) the
#            BF16-x row (+quant) is the fused decode kernel (x quantized in-kernel, one launch)
#            and +quant:once the act_quantize + QArray kernel path beside it (the model:
#            1.02-1.26x at 16 rows, 1.06-1.23x where it picks it at 32 / 64)
#   quantize experiments/bench_quantize.py: per-token FP8 activation quantization (standalone,
#            + RMSNorm, + SwiGLU), XLA's fusions vs the one-launch act_quantize kernels, M 16-16384
#            (the kernels now run at every M: the prefill side had not been measured)
#   decode   experiments/bench_decode.py: decode attention GB/s vs the HBM peak, FP8 and BF16 caches
#            (the swap-AB default, unswapped, and on FP8 the 128-slot tiles and the 3-stage ring
#            the default had before its 5-stage one: :bs128, :st3; the model fitted to the first
#            run puts 5 stages at the HBM bound, 3 at 62-64% of an H200's)
#   rollout  experiments/bench_rollout.py: tokens/s BF16 vs W8A8 vs W8A8 + FP8 KV, Qwen3-1.7B shape
#            (random weights), 1K-token prompts, 4K-token responses, batch 32, no stop tokens
#   host_sync  experiments/bench_host_sync.py: per iteration, a fori vs a data-bounded while vs
#            one with a cond: the cost of a loop predicate / branch index (the model's HOST_SYNC_S)
#   moe, engine  HOOK: experiments/bench_moe.py and experiments/bench_engine.py, built in parallel
#            (grouped MoE GEMM, paged engine): run if the file exists, as
#            `python <script> [--quick] --out <stages>/bench_<name>.json` (a .md beside it is shown)
#   serve    experiments/serve_check.py: our block-FP8 export served by vLLM for a few prompts,
#            when vLLM is installed there (skipped otherwise)
#   perf_model  kernels_pallas/perf_model/compare.py: measured matmul, decode attention and grouped
#            (MoE: FP8, and the BF16 gmm) rows (swap-AB and unswapped) and the rollout's decode
#            step beside the model's predictions (issue 21)
#   autotune kernels_pallas/autotune.py: the on-device autotuner's chosen tables: the decode
#            attention kernels' tilings (dense and paged, FP8 cache: chunks, stages, swap-AB;
#            ~6 candidates each) beside the default, the grouped FP8 kernel's tiles (MoE gate+up
#            at 512 and 65,536 rows; 4-6 candidates), then fp8_matmul's (FP8 candidates vs the
#            BF16 floor), last the BF16 grouped kernels' (MoE training: forward, input and weight
#            gradient of one expert GEMM, 5 candidates each, ~45 s: the first rows the stage's
#            190 s cut, ~240 s for all at ~3.4 s a candidate); every candidate's time is in
#            stages/autotune.json. The tuners run at trace time inside jitted programs too
#            (autotune.lookup_or_tune: jax.ensure_compile_time_eval)
#   report   experiments/gpu_report.py: summary.md (targets next to measured numbers) + summary.json
#
# Output: $OUT when set (the device tool copies back what is written there), else
# $GPU_CHECK_OUT, else experiments/results/gpu/<UTC date-time>/: summary.md, summary.json and the
# stages' files (stage logs, env.json, pytest.xml, bench_*.json/.md) in stages/; under $OUT they
# are packed into stages.tgz (the device tool returns at most 8 files).
#
# Python: $PYTHON, else python3 -- the machine's own, with its preinstalled jax (0.11.2, CUDA 13 on
# the lent H200). This script never installs jax. If a pure-python dependency is missing and wheels
# were carried in .whl/, it makes a venv with --system-site-packages (the machine's jax stays) in
# /tmp and installs those wheels with --no-index --no-deps, skipping any jax wheel.
# Env: GPU_CHECK_BUDGET_S (global budget, default 540), GIT_SHA (a tree copied without .git),
# GPU_CHECK_STAGES (run only these stages, e.g. "pytest matmul"; env and the report always run),
# GPU_CHECK_BUDGETS (per-stage budgets over the defaults below, e.g. "rollout=250 matmul=120"),
# GPU_CHECK_ARGS_<stage> (extra arguments for that stage's command, e.g.
# GPU_CHECK_ARGS_matmul="--ms 4096 16"): a short lease splits the check into calls this way,
# JAX_COMPILATION_CACHE_DIR (default /tmp/fp8rl_jax_gpu_cache: a rerun on a warm machine reuses
# compiled programs; compile times in the JSON are then cache loads).
#
# What has been run: `--quick` on a CPU machine (2 cores, jax 0.12.0.1 and 0.11.2), and twice on
# one H200 (jax 0.11.2, CUDA 13, 2026-12-04; experiments/results/gpu_h200_2026-12-04) in a
# 15-minute lease, as two calls:
#   GPU_CHECK_BUDGET_S=450 GPU_CHECK_STAGES="pytest matmul decode rollout host_sync perf_model
#     autotune" GPU_CHECK_ARGS_matmul="--ms 4096 16 64" (with per-stage GPU_CHECK_BUDGETS)
#   then, after fixing what it found, GPU_CHECK_STAGES="pytest matmul decode perf_model autotune"
#     GPU_CHECK_ARGS_matmul="--ms 16 64".
# Stage times seen there (the defaults below follow them): env 4 s; pytest 60-65 s (41 tests,
# -n 4); matmul 44 s per M value over the 6 layers (4 arms; 6 arms at M <= 128); decode 44 s;
# rollout 65-80 s per variant (compiles 17-38 s + 10-23 s, a 4K-token rollout 15-18 s); host_sync
# 6 s; autotune > 85 s for one shape before its candidates were cut to the model's best 6
# (tuning.TUNE_LIMIT). All stages need ~14 minutes: one call (<= 10 minutes) runs a subset.
# What the next lease should run (what the first one did not: the quantize stage, the pruned
# fp8_matmul and the attention autotuners, the grouped kernel's device tests, Qwen3-8B's rollout,
# the 5-stage FP8 attention default beside decode's :st3 and :bs128 arms, ~+20 s, 3 more
# attention autotune candidates per shape, ~+30 s, and the overlapped prefill GEMM and the
# two-slice decode GEMM beside matmul's :plain arm, ~+11 s and ~+60 s for M = 16; the decode
# GEMMs launched dependent beside matmul's :nopdl arm, and pytest's chain of dependent GEMMs,
# ~+20 s), as two calls of ~6.5 minutes:
#   GPU_CHECK_BUDGET_S=400 GPU_CHECK_STAGES="pytest quantize autotune matmul"
#     GPU_CHECK_BUDGETS="pytest=90 quantize=45 autotune=120 matmul=135"
#     GPU_CHECK_ARGS_matmul="--ms 4096 16"
#   GPU_CHECK_BUDGET_S=400 GPU_CHECK_STAGES="rollout decode perf_model"
#     GPU_CHECK_BUDGETS="rollout=300 decode=70 perf_model=20"
#     GPU_CHECK_ARGS_rollout="--model qwen3-8b --variants bf16 w8a8_fp8kv"
# (decode and perf_model in one call: perf_model reads that call's bench files)
# With time left, the tiles the dispatch's model picks beside the rules' (matmul's
# :rules arm, at the M values where they differ; ~50-60 s per M value):
#   GPU_CHECK_STAGES="matmul perf_model" GPU_CHECK_ARGS_matmul="--ms 256 128"
# and raw x at 32 rows, where the model runs the fused kernel on some shapes (matmul's
# "+quant" arm beside "+quant:once", the act_quantize launch then the QArray kernel):
#   GPU_CHECK_STAGES="matmul perf_model" GPU_CHECK_ARGS_matmul="--ms 32"
# and the same rollout launched plainly (FP8RL_PDL=0: no kernel launches dependent,
# read at trace time; bench_rollout's meta records decode_pdl, so the model predicts it as run):
#   FP8RL_PDL=0 GPU_CHECK_STAGES="rollout" GPU_CHECK_ARGS_rollout="--model qwen3-8b --variants
#     w8a8_fp8kv"
set -uo pipefail # no -e: a failed stage must not stop the others

cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
QUICK=()
[ "${1:-}" = "--quick" ] && QUICK=(--quick)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
RESERVE=20 # seconds kept for the report

# The global timeout: the whole script re-runs under `timeout`, a net for anything the per-stage
# budgets do not bound (each stage's own timeout already ends before the deadline).
if [ -z "${GPU_CHECK_INNER:-}" ]; then
  GPU_CHECK_INNER=1 exec timeout --kill-after=10 $((BUDGET + 30)) bash "$0" "$@"
fi

START=$(date +%s)
DEADLINE=$((START + BUDGET))
OUTDIR=${OUT:-${GPU_CHECK_OUT:-experiments/results/gpu/$(date -u +%Y%m%d-%H%M%S)}}
STAGES=$OUTDIR/stages
mkdir -p "$STAGES"
: >"$STAGES/status.tsv"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/fp8rl_jax_gpu_cache}
FAILED=()

log() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }

record() { # name rc seconds budget note (one line: the note's tabs and newlines as spaces)
  local note=${5:-}
  note=${note//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${note//$'\t'/ }" >>"$STAGES/status.tsv"
}

# run_stage NAME BUDGET_S CMD...: runs CMD under `timeout` (the smaller of BUDGET_S and what is
# left before the deadline, less the report's reserve), output to stages/NAME.log.
run_stage() {
  local name=$1 budget=$2 left t0 rc kv extra_var
  shift 2
  if [ "$name" != env ] && [ -n "${GPU_CHECK_STAGES:-}" ] &&
    [[ " $GPU_CHECK_STAGES " != *" $name "* ]]; then
    record "$name" skipped 0 0 "not in GPU_CHECK_STAGES ($GPU_CHECK_STAGES)"
    return
  fi
  for kv in ${GPU_CHECK_BUDGETS:-}; do
    [ "${kv%%=*}" = "$name" ] && budget=${kv#*=}
  done
  extra_var="GPU_CHECK_ARGS_$name"
  # shellcheck disable=SC2206 # word splitting of the extra arguments is the point
  [ -n "${!extra_var:-}" ] && set -- "$@" ${!extra_var}
  left=$((DEADLINE - $(date +%s) - RESERVE))
  ((left < budget)) && budget=$left
  if ((budget < 5)); then
    log "$name: skipped, no time left"
    record "$name" skipped 0 0 "no time left in the ${BUDGET}s budget"
    FAILED+=("$name")
    return
  fi
  log "$name: start (budget ${budget}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" >"$STAGES/$name.log" 2>&1
  rc=$?
  record "$name" "$rc" "$(($(date +%s) - t0))" "$budget" "$*"
  if ((rc == 0)); then
    log "$name: ok ($(($(date +%s) - t0))s)"
  else
    FAILED+=("$name")
    log "$name: FAILED rc=$rc ($( ((rc == 124 || rc == 137)) && echo timeout || echo error)); log tail:"
    tail -n 15 "$STAGES/$name.log" | sed 's/^/    /'
  fi
}

# ---------------------------------------------------------------------------- python
PY=${PYTHON:-python3}
missing=$("$PY" -c 'import importlib.util as u, sys
print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' \
  jax numpy jinja2 safetensors tokenizers pytest 2>/dev/null) || missing="python"
if [[ " $missing " == *" jax "* || $missing == python ]]; then
  log "no jax in '$PY' ($missing missing): set PYTHON to the machine's python; jax is never installed"
  exit 2
fi
if [ -n "$missing" ]; then
  mapfile -t wheels < <(ls .whl/*.whl 2>/dev/null | grep -vi '^\.whl/jax')
  if ((${#wheels[@]})); then
    log "missing: $missing; installing the wheels in .whl/ into a venv over the machine's packages"
    "$PY" -m venv --system-site-packages /tmp/fp8rl_gpu_venv &&
      /tmp/fp8rl_gpu_venv/bin/python -m pip install -q --no-index --no-deps "${wheels[@]}" &&
      PY=/tmp/fp8rl_gpu_venv/bin/python
  else
    log "missing python modules: $missing (carry their wheels in .whl/); stages that need them fail"
  fi
fi
log "python: $PY; output: $OUTDIR"

# ---------------------------------------------------------------------------- stages
run_stage env 30 "$PY" experiments/gpu_report.py env --out "$STAGES/env.json"
command -v nvidia-smi >/dev/null && nvidia-smi >"$STAGES/nvidia-smi.txt" 2>&1
platform=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["platform"])' \
  "$STAGES/env.json" 2>/dev/null || echo unknown)
if [ "$platform" != gpu ] && [ ${#QUICK[@]} -eq 0 ]; then
  log "jax sees no GPU (platform: $platform): the full benchmarks are for a GPU; use --quick here"
  record benchmarks skipped 0 0 "no GPU (platform $platform); run with --quick"
  FAILED+=(no-gpu)
else
  mapfile -t gpu_tests < <(grep -l 'mark\.gpu' tests/test_*.py kernels_pallas/*/test_*.py)
  xdist=()
  if [ "$platform" = gpu ] && "$PY" -c 'import xdist' 2>/dev/null; then
    xdist=(-n 4 --dist load) # compiles in parallel; the workers share the GPU
  fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_stage pytest 90 "$PY" -m pytest -m gpu -q -rfE \
    -p no:cacheprovider "${xdist[@]}" --junitxml="$STAGES/pytest.xml" "${gpu_tests[@]}"
  run_stage matmul 240 "$PY" experiments/bench_matmul.py "${QUICK[@]}" \
    --out "$STAGES/bench_matmul.json"
  run_stage quantize 45 "$PY" experiments/bench_quantize.py "${QUICK[@]}" \
    --out "$STAGES/bench_quantize.json"
  run_stage decode 70 "$PY" experiments/bench_decode.py "${QUICK[@]}" \
    --out "$STAGES/bench_decode.json"
  run_stage rollout 240 "$PY" experiments/bench_rollout.py "${QUICK[@]}" \
    --out "$STAGES/bench_rollout.json"
  # what a decode loop's predicate and a cond's branch index cost (the model's HOST_SYNC_S)
  run_stage host_sync 20 "$PY" experiments/bench_host_sync.py "${QUICK[@]}" \
    --out "$STAGES/bench_host_sync.json"
  # ---- HOOK: benchmarks being built in parallel (grouped MoE GEMM, paged engine) ----
  hook_budget=45 # on a GPU; the CPU --quick modes of these benchmarks take ~2 minutes
  ((${#QUICK[@]})) && hook_budget=150
  for hook in moe engine; do
    if [ -f "experiments/bench_$hook.py" ]; then
      run_stage "$hook" "$hook_budget" "$PY" "experiments/bench_$hook.py" "${QUICK[@]}" \
        --out "$STAGES/bench_$hook.json"
    else
      record "$hook" skipped 0 0 "experiments/bench_$hook.py not in this tree"
    fi
  done
  # Issue 21, last (they take what the budget leaves): the performance model's prediction beside
  # each measured row, and the calibration factors and latency / fill fit this run's files give
  # (the committed ones are the first H200 run's: perf_model/calibration.py) (stages/
  # perf_model.log), then the on-device autotuner's chosen table (stages/autotune.log; cache:
  # stages/autotune.json and ~/.cache/fp8rl_jax).
  run_stage perf_model 20 bash -c '"$0" -m kernels_pallas.perf_model.compare "$@"; rc=$?
    "$0" -m kernels_pallas.perf_model.calibration "$@"
    "$0" -m kernels_pallas.perf_model.calibration "$@" --fit; exit $rc' "$PY" \
    "$STAGES/bench_matmul.json" \
    "$STAGES/bench_decode.json" "$STAGES/bench_moe.json" "$STAGES/bench_rollout.json"
  FP8RL_AUTOTUNE_FILE="$STAGES/autotune.json" run_stage autotune 190 "$PY" -m kernels_pallas.autotune
  for f in perf_model autotune; do [ -f "$STAGES/$f.log" ] && cat "$STAGES/$f.log"; done
fi
# serve: our block-FP8 export loaded and run by vLLM (only where vLLM is installed)
if [ ${#QUICK[@]} -eq 0 ] && "$PY" -c 'import vllm' 2>/dev/null; then
  serve_dir=/tmp/fp8rl_serve_check
  JAX_PLATFORMS=cpu run_stage serve_export 60 "$PY" experiments/serve_check.py export "$serve_dir"
  run_stage serve 120 "$PY" experiments/serve_check.py serve "$serve_dir" \
    --out "$STAGES/serve_check.json"
else
  record serve skipped 0 0 "vLLM not installed (or --quick): the FP8 export is not served"
fi

# ---------------------------------------------------------------------------- report
report=$(mktemp)
timeout 60 "$PY" experiments/gpu_report.py summarize "$STAGES" --out-dir "$OUTDIR" \
  >"$report" 2>&1 || FAILED+=(report)
if [ -n "${OUT:-}" ] && [ -d "$STAGES" ]; then
  tar czf "$OUTDIR/stages.tgz" -C "$OUTDIR" stages && rm -rf "$STAGES"
fi
cat "$report" # the stage and target tables, last: what a short tail of the output shows
rm -f "$report"
log "done in $(($(date +%s) - START))s; output in $OUTDIR"
if ((${#FAILED[@]})); then
  log "FAILED stages: ${FAILED[*]}"
  exit 1
fi
log "all stages ok"
