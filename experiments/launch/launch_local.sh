#!/usr/bin/env bash
# Runs N cooperating JAX processes on this machine (jax.distributed over loopback).
#
#   experiments/launch/launch_local.sh N [--cpu DEVICES_PER_PROCESS] -- COMMAND [ARGS...]
#
# Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT, JAX_NUM_PROCESSES=N and its own
# JAX_PROCESS_ID; fp8rl_jax.train.distributed.maybe_initialize_distributed() reads them.
# --cpu K: CPU-only processes with K fake devices each (gloo collectives), for smoke tests.
# On a GPU machine without --cpu, process i sees GPU i only (CUDA_VISIBLE_DEVICES=i).
# Logs go to ${LOG_DIR:-runs/launch_local}/proc_<i>.log; the script exits non-zero if any
# process fails, and kills the others.
#
# Examples:
#   # 2 processes x 2 CPU devices: the multi-process trainer smoke run (4-device mesh)
#   experiments/launch/launch_local.sh 2 --cpu 2 -- python -m tests.trainer_sharded_worker \
#       --devices 2 --mesh data=2,fsdp=2 --set trainer.run_dir=/tmp/fp8rl_mp_run
#   # 8 GPUs, one process each, the multi-host entry point:
#   experiments/launch/launch_local.sh 8 -- python experiments/launch/train_multihost.py \
#       --config=experiments/configs/qwen3_8b_multihost.py
set -euo pipefail

N=${1:?usage: launch_local.sh N [--cpu K] -- COMMAND...}
shift
CPU_DEVICES=""
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    --cpu) CPU_DEVICES=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "missing COMMAND after --" >&2; exit 2; }

PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
cd "$(dirname "$0")/../.."
LOG_DIR=${LOG_DIR:-runs/launch_local}
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COORDINATOR_ADDRESS="127.0.0.1:$PORT" JAX_NUM_PROCESSES="$N"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

for ((i = 0; i < N; i++)); do
  (
    export JAX_PROCESS_ID=$i
    if [[ -n "$CPU_DEVICES" ]]; then
      export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$CPU_DEVICES"
    else
      export CUDA_VISIBLE_DEVICES=$i
    fi
    # The worker script in tests/ takes its process id as a flag; other commands read the env.
    extra=()
    [[ "$*" == *"tests.multiprocess_worker"* ]] && extra=(--process-id "$i" --port "$PORT"
                                                         --devices "${CPU_DEVICES:-1}")
    exec "$@" "${extra[@]}"
  ) >"$LOG_DIR/proc_$i.log" 2>&1 &
  pids+=($!)
done

status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "process $i failed; see $LOG_DIR/proc_$i.log" >&2
    status=1
  fi
done
trap - EXIT
[[ $status -eq 0 ]] && echo "all $N processes finished; logs in $LOG_DIR"
exit $status
