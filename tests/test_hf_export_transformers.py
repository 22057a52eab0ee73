"""Our BF16 and block-FP8 exports, loaded by code nobody here wrote: transformers' own loader.

``transformers`` (with torch) runs in the side venv ``.hfvenv`` (``bash scripts/setup_hf.sh``;
torch's CPU wheel needs Python 3.11 here), through ``tests/hf_logits_worker.py``; the test is
skipped when that venv is absent (CI builds it: ``.ci/run``). transformers reads the FP8
export's ``quantization_config`` (``ignored_layers`` as ``modules_to_not_convert``) and, on a
CPU, dequantizes ``weight · weight_scale_inv`` itself; its logits must equal ours over the same
checkpoint loaded by our loader (f32 rounding of two implementations: measured ~4e-6).
"""

import json
import os
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation import RolloutConfig, cast_floats, rollout_weights
from fp8rl_jax.models import forward, load_hf_checkpoint, save_fp8_checkpoint, save_hf_checkpoint
from fp8rl_jax.quant import QuantRecipe

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "hf"
HF_PYTHON = Path(os.environ.get("FP8RL_HF_PYTHON", REPO / ".hfvenv" / "bin" / "python"))
pytestmark = pytest.mark.skipif(
    not HF_PYTHON.exists(), reason=f"no transformers venv at {HF_PYTHON} (scripts/setup_hf.sh)"
)
TOKENS = [[1, 5, 9, 17, 33, 60, 2, 7, 11, 90], [3, 3, 40, 41, 42, 127, 64, 8, 1, 2]]
RECIPE = QuantRecipe(weight_block=(32, 32), act_group=32)  # the fixtures' sizes: whole blocks
CASES = {  # name: (fixture, recipe)
    "dense": ("qwen3", RECIPE),
    "moe": ("qwen3_moe", RECIPE),
    "kept_layer": ("qwen3", QuantRecipe(weight_block=(32, 32), act_group=32, keep_first_n=1)),
}


def _transformers_logits(tmp_path, dirs):
    out = tmp_path / "hf_logits.npz"
    argv = [str(HF_PYTHON), str(REPO / "tests" / "hf_logits_worker.py"), str(out)]
    proc = subprocess.run(
        [*argv, json.dumps(TOKENS), *map(str, dirs)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = np.load(out)
    return [ref[f"logits_{i}"] for i in range(len(dirs))]


def _our_logits(path):
    cfg, w = load_hf_checkpoint(path, dtype=jnp.float32)  # the FP8 export: dequantized
    return np.asarray(forward(w, jnp.asarray(TOKENS, jnp.int32), cfg).logits_BTV)


def test_transformers_loads_our_exports_to_our_logits(tmp_path):
    dirs, kinds = [], []
    for name, (fixture, recipe) in CASES.items():
        cfg, params = load_hf_checkpoint(FIX / fixture, dtype=jnp.float32)
        weights, _ = rollout_weights(params, RolloutConfig(quant=recipe))
        save_fp8_checkpoint(tmp_path / f"{name}_fp8", cfg, weights, extra_files_from=FIX / fixture)
        save_hf_checkpoint(tmp_path / f"{name}_bf16", cfg, cast_floats(params, jnp.bfloat16))
        dirs += [tmp_path / f"{name}_fp8", tmp_path / f"{name}_bf16"]
        kinds += [f"{name} fp8", f"{name} bf16"]
    theirs = _transformers_logits(tmp_path, dirs)
    for kind, d, ref in zip(kinds, dirs, theirs, strict=True):
        ours = _our_logits(d)
        assert np.abs(ours - ref).max() < 1e-4, (kind, np.abs(ours - ref).max())
    # the exports differ where they should: FP8 is not BF16, the kept layer changes the FP8 one
    assert np.abs(theirs[0] - theirs[1]).max() > 1e-3  # dense: fp8 vs bf16
    assert np.abs(theirs[4] - theirs[0]).max() > 1e-4  # kept layer 0 vs all FP8
    quant = json.loads((tmp_path / "kept_layer_fp8" / "config.json").read_text())
    assert "model.layers.0.self_attn.qkv_proj" in quant["quantization_config"]["ignored_layers"]
