#!/usr/bin/env bash
# Builds the deviceless ahead-of-time (AOT) compile toolchain in its own venv under .aot/ (never
# touches .venv): jax/jaxlib, the jax CUDA plugin/pjrt and its ptxas for H100, the libtpu that
# jax[tpu] pins for TPU v5e/v6e, and this project (editable).
#
#   bash scripts/setup_aot.sh                    # jax of .venv (0.12.0.1), CUDA 12 -> .aot/venv
#   bash scripts/setup_aot.sh 0.11.2             # the GPU machine's jax, CUDA 13  -> .aot/venv-0.11.2
#   bash scripts/setup_aot.sh 0.11.2 --cuda=12   # any version, other CUDA major   -> .aot/venv-0.11.2-cuda12
#
# CUDA 12: jax-cuda12-plugin/pjrt + ptxas 12.9 (nvidia-cuda-nvcc-cu12). CUDA 13: jax-cuda13-plugin/
# pjrt + ptxas 13.0 (nvidia-cuda-nvcc 13.0.x), what the lent GPU machine runs (jax 0.11.2 with
# jax-cuda13-plugin, nvcc 13.0, driver 580), so 0.11.2 defaults to it. The ptxas version matters:
# its PTX ISA decides which FP8 conversions Mosaic GPU lowers.
#
# Then: .aot/venv/bin/python scripts/aot_check.py (see the README, "Ahead-of-time compile
# check"). Safe to re-run: a venv with a current stamp is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC12_VERSION=12.9.86 # ptxas 12.9 (PTX ISA 8.8)
NVCC13_VERSION=13.0.88 # ptxas 13.0 (PTX ISA 9.0), the GPU machine's nvcc
CUDA13_DEFAULT_JAX=0.11.2 # jax versions whose toolchain defaults to CUDA 13 (the GPU machine's)
# cuobjdump + nvdisasm: SASS of the compiled kernels for the performance model (perf_model/sass.py)
SASS_TOOLS_VERSION=13.5.37

if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
main_jax=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')
version=""
cuda=""
for arg in "$@"; do
  case "$arg" in
    --cuda=12 | --cuda=13) cuda=${arg#--cuda=} ;;
    -*) echo "setup_aot: unknown option $arg (usage: setup_aot.sh [JAX_VERSION] [--cuda=12|13])" >&2; exit 2 ;;
    *) version=$arg ;;
  esac
done
version=${version:-$main_jax}
default_cuda=12
[[ " $CUDA13_DEFAULT_JAX " == *" $version "* ]] && default_cuda=13
cuda=${cuda:-$default_cuda}
if [ "$version" = "$main_jax" ]; then
  venv=.aot/venv
else
  venv=.aot/venv-$version
fi
[ "$cuda" != "$default_cuda" ] && venv=$venv-cuda$cuda
if [ "$cuda" = 13 ]; then
  nvcc_version=$NVCC13_VERSION
  cuda_pkgs=("jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version" "nvidia-cuda-nvcc==$nvcc_version")
else
  nvcc_version=$NVCC12_VERSION
  cuda_pkgs=("jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version" "nvidia-cuda-nvcc-cu12==$nvcc_version")
fi

stamp=$venv/.aot_installed
want="jax==$version cuda$cuda nvcc==$nvcc_version sass==$SASS_TOOLS_VERSION"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ ! scripts/setup_aot.sh -nt "$stamp" ] &&
  [ ! pyproject.toml -nt "$stamp" ]; then
  echo "setup_aot: ready ($venv, $want)"
  exit 0
fi

start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p .aot
  # .venv's interpreter makes a venv on its base Python (same version as the main venv).
  .venv/bin/python -m venv "$venv"
fi
echo "setup_aot: installing jax $version + CUDA $cuda plugin + ptxas $nvcc_version + libtpu into $venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# One resolve, so the project's dependencies cannot move jax off $version. jax[tpu] pins its
# libtpu (0.0.50.* for 0.12.0.1, 0.0.48.* for 0.11.2) and jaxlib.
"$venv/bin/python" -m pip install -q \
  "jax[tpu]==$version" \
  "${cuda_pkgs[@]}" \
  "nvidia-cuda-cuobjdump==$SASS_TOOLS_VERSION" \
  "nvidia-cuda-nvdisasm==$SASS_TOOLS_VERSION" \
  -e .
"$venv/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$version')" || {
  echo "setup_aot: $venv has jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)'), wanted $version" >&2
  exit 1
}
echo "$want" >"$stamp"
echo "setup_aot: ready ($venv, $want) in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
