#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) in the repo root, installs the project editable with its test
# extras, and the jax build for the machine's accelerator. Safe to re-run: an existing .venv with
# the project installed for the same accelerator is reused.
#
#   bash scripts/setup.sh                  # detect: NVIDIA GPU (driver >= 580: cuda13, >= 525:
#                                          # cuda12), TPU (/dev/accel*, /dev/vfio), else cpu
#   bash scripts/setup.sh --accel=cuda12   # or cuda13, tpu, cpu (also: FP8RL_ACCEL=cuda12)
#   bash scripts/setup.sh --dry-run        # print what it would install, change nothing
#
# The accelerator build is jax[cuda12] / jax[cuda13] / jax[tpu] at the jax version of
# requirements.txt (the one the suite passed with), installed into the same .venv after the
# project. An explicit --accel that the machine cannot run (no GPU, a driver too old for the CUDA
# major, no TPU device) is refused before anything is installed. At the end it prints the devices
# jax sees, and fails if they are not the accelerator asked for.
# Detection can be pointed elsewhere (tests): FP8RL_NVIDIA_SMI (the nvidia-smi command),
# FP8RL_TPU_DEVICES (a glob of TPU device files).
set -euo pipefail
cd "$(dirname "$0")/.."

ACCEL=${FP8RL_ACCEL:-auto}
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --accel=*) ACCEL=${arg#--accel=} ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help)
      sed -n '2,19p' "$0"
      exit 0
      ;;
    *)
      echo "setup: unknown argument $arg (use --accel=auto|cpu|cuda12|cuda13|tpu, --dry-run)" >&2
      exit 2
      ;;
  esac
done
NVIDIA_SMI=${FP8RL_NVIDIA_SMI:-nvidia-smi}
TPU_DEVICES=${FP8RL_TPU_DEVICES:-/dev/accel* /dev/vfio/[0-9]*}
MIN_DRIVER_CUDA12=525 # CUDA 12.x needs an NVIDIA driver >= 525.60 (jax's install guide)
MIN_DRIVER_CUDA13=580 # CUDA 13.x needs >= 580

die() {
  echo "setup: $*" >&2
  exit 2
}

# "<driver major> <gpu name>" of the first GPU, or nothing when there is no working nvidia-smi.
gpu_info() {
  command -v "${NVIDIA_SMI%% *}" >/dev/null 2>&1 || return 0
  $NVIDIA_SMI --query-gpu=driver_version,name --format=csv,noheader 2>/dev/null | head -1 |
    awk -F', ' 'NF >= 2 { split($1, v, "."); print v[1], $2 }'
}

tpu_found() {
  local f
  for f in $TPU_DEVICES; do
    [ -e "$f" ] && return 0
  done
  return 1
}

gpu=$(gpu_info)
driver=${gpu%% *}
case "$ACCEL" in
  auto)
    if [ -n "$gpu" ] && [ "$driver" -ge $MIN_DRIVER_CUDA13 ]; then
      ACCEL=cuda13
    elif [ -n "$gpu" ] && [ "$driver" -ge $MIN_DRIVER_CUDA12 ]; then
      ACCEL=cuda12
    elif [ -n "$gpu" ]; then
      die "found ${gpu#* } with NVIDIA driver $driver, older than CUDA 12's minimum" \
        "($MIN_DRIVER_CUDA12); update the driver, or pass --accel=cpu"
    elif tpu_found; then
      ACCEL=tpu
    else
      ACCEL=cpu
    fi
    echo "setup: detected accelerator: $ACCEL${gpu:+ (${gpu#* }, driver $driver)}"
    ;;
  cuda12 | cuda13)
    want=$MIN_DRIVER_CUDA12
    [ "$ACCEL" = cuda13 ] && want=$MIN_DRIVER_CUDA13
    [ -n "$gpu" ] || die "--accel=$ACCEL asked for, but no NVIDIA GPU was found" \
      "($NVIDIA_SMI does not run or lists no GPU); on this machine use --accel=cpu"
    [ "$driver" -ge "$want" ] || die "--accel=$ACCEL needs an NVIDIA driver >= $want, found" \
      "$driver on ${gpu#* }; use --accel=cuda12 (driver >= $MIN_DRIVER_CUDA12) or update the driver"
    ;;
  tpu)
    tpu_found || die "--accel=tpu asked for, but no TPU device ($TPU_DEVICES) was found;" \
      "run on a TPU VM, or use --accel=cpu"
    ;;
  cpu) ;;
  *) die "unknown accelerator '$ACCEL' (use auto, cpu, cuda12, cuda13 or tpu)" ;;
esac

JAX_VERSION=$(sed -n 's/^jax==\([^ ]*\).*/\1/p' requirements.txt)
[ -n "$JAX_VERSION" ] || die "no 'jax==' line in requirements.txt"
want_stamp="accel=$ACCEL jax=$JAX_VERSION"
accel_cmd=()
[ "$ACCEL" != cpu ] && accel_cmd=(.venv/bin/python -m pip install -q "jax[$ACCEL]==$JAX_VERSION")

if [ "$DRY_RUN" = 1 ]; then
  echo "setup: dry run for accel=$ACCEL (nothing is installed)"
  echo "would run: .venv/bin/python -m pip install -q -e .[dev]"
  if [ ${#accel_cmd[@]} -gt 0 ]; then
    echo "would run: ${accel_cmd[*]}"
  fi
  exit 0
fi

find_python() {
  local cand
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
      "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$cand"
      return 0
    fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for cand in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -Vr); do
    if [ -x "$cand/bin/python" ]; then
      echo "$cand/bin/python"
      return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "setup: no Python >= 3.12 found on PATH or under ${PYENV_ROOT:-$HOME/.pyenv}/versions." >&2
    echo "setup: install one (e.g. 'pyenv install 3.12') and re-run." >&2
    exit 1
  fi
  echo "setup: creating .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
fi
stamp=.venv/.fp8rl_installed
# A stamp from before accelerators were recorded (empty) means cpu.
have_stamp=$( [ -f "$stamp" ] && cat "$stamp" || true)
[ -f "$stamp" ] && [ -z "$have_stamp" ] && have_stamp="accel=cpu jax=$JAX_VERSION"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$have_stamp" != "$want_stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  if [ ${#accel_cmd[@]} -gt 0 ]; then
    echo "setup: installing jax[$ACCEL]==$JAX_VERSION"
    "${accel_cmd[@]}"
  fi
  echo "$want_stamp" >"$stamp"
fi
devices=$(.venv/bin/python -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())')
echo "setup: ready (accel=$ACCEL, jax $devices)"
backend=$(echo "$devices" | cut -d' ' -f2)
case "$ACCEL" in
  cuda*) [ "$backend" = gpu ] || die "installed jax[$ACCEL] but jax runs on '$backend'; see above" ;;
  tpu) [ "$backend" = tpu ] || die "installed jax[tpu] but jax runs on '$backend'; see above" ;;
esac
