#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) in the repo root and installs the project editable with its test
# extras. Safe to re-run: an existing .venv with the project installed is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
echo "setup: ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
