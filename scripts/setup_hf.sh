#!/usr/bin/env bash
# Builds the side venv .hfvenv (git-ignored) with torch (CPU) + transformers, used by the tests that
# load our exports with code nobody here wrote (tests/test_hf_export.py) and to regenerate the HF
# fixtures (tests/fixtures/hf/make_fixtures.py). Never touches .venv.
#
#   bash scripts/setup_hf.sh
#
# torch's CPU wheel is only available for Python 3.11 here, so .hfvenv is a Python 3.11 venv
# ($HF_PYTHON, else python3.11 on PATH, else pyenv's 3.11.x). Safe to re-run: a venv with a current
# stamp is reused. Without a Python 3.11 it says so and exits 0 (the tests that need it skip).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
TRANSFORMERS_SPEC="transformers>=5.18,<6"
want="torch==$TORCH_VERSION $TRANSFORMERS_SPEC accelerate"
stamp=.hfvenv/.hf_installed
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ ! scripts/setup_hf.sh -nt "$stamp" ]; then
  echo "setup_hf: ready (.hfvenv, $want)"
  exit 0
fi

find_py311() {
  local cand
  for cand in "${HF_PYTHON:-}" python3.11; do
    if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 &&
      "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      command -v "$cand"
      return 0
    fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for cand in $(ls -d "$root"/versions/3.11* 2>/dev/null | sort -Vr); do
    if [ -x "$cand/bin/python" ]; then
      echo "$cand/bin/python"
      return 0
    fi
  done
  return 1
}

if [ ! -x .hfvenv/bin/python ]; then
  if ! PY=$(find_py311); then
    echo "setup_hf: no Python 3.11 found (set HF_PYTHON); skipping .hfvenv, the transformers" \
      "round-trip tests will skip" >&2
    exit 0
  fi
  echo "setup_hf: creating .hfvenv with $PY"
  "$PY" -m venv .hfvenv
fi
start=$(date +%s)
# torch alone and first (its CPU wheel; no CUDA libraries), then transformers beside it.
.hfvenv/bin/python -m pip install -q "torch==$TORCH_VERSION"
.hfvenv/bin/python -m pip install -q "$TRANSFORMERS_SPEC" safetensors numpy tokenizers jinja2 ml_dtypes accelerate
echo "$want" >"$stamp"
echo "setup_hf: ready (.hfvenv: $(.hfvenv/bin/python -c 'import torch, transformers as t; print("torch", torch.__version__, "transformers", t.__version__)')) in $(($(date +%s) - start)) s"
