#!/usr/bin/env bash
# Builds the deviceless ahead-of-time (AOT) compile toolchain in its own venv under .aot/ (never
# touches .venv): jax/jaxlib, jax-cuda12-plugin/pjrt and ptxas (nvidia-cuda-nvcc-cu12) for
# H100, the libtpu that jax[tpu] pins for TPU v5e/v6e, and this project (editable).
#
#   bash scripts/setup_aot.sh           # jax of .venv (0.12.0.1)  -> .aot/venv
#   bash scripts/setup_aot.sh 0.11.2    # another jax version      -> .aot/venv-0.11.2
#
# Then: .aot/venv/bin/python scripts/aot_check.py (see the README, "Ahead-of-time compile
# check"). Safe to re-run: a venv with a current stamp is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC_VERSION=12.9.86  # ptxas 12.9: the PTX ISA (8.8) decides which FP8 conversions lower
# cuobjdump + nvdisasm: SASS of the compiled kernels for the performance model (perf_model/sass.py)
SASS_TOOLS_VERSION=13.5.37

if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
main_jax=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')
version=${1:-$main_jax}
if [ "$version" = "$main_jax" ]; then
  venv=.aot/venv
else
  venv=.aot/venv-$version
fi

stamp=$venv/.aot_installed
want="jax==$version nvcc==$NVCC_VERSION sass==$SASS_TOOLS_VERSION"
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
echo "setup_aot: installing jax $version + CUDA plugin + ptxas $NVCC_VERSION + libtpu into $venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# One resolve, so the project's dependencies cannot move jax off $version. jax[tpu] pins its
# libtpu (0.0.50.* for 0.12.0.1, 0.0.48.* for 0.11.2) and jaxlib.
"$venv/bin/python" -m pip install -q \
  "jax[tpu]==$version" \
  "jax-cuda12-plugin==$version" \
  "jax-cuda12-pjrt==$version" \
  "nvidia-cuda-nvcc-cu12==$NVCC_VERSION" \
  "nvidia-cuda-cuobjdump==$SASS_TOOLS_VERSION" \
  "nvidia-cuda-nvdisasm==$SASS_TOOLS_VERSION" \
  -e .
"$venv/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$version')" || {
  echo "setup_aot: $venv has jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)'), wanted $version" >&2
  exit 1
}
echo "$want" >"$stamp"
echo "setup_aot: ready ($venv, $want) in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
