"""Parity with transformers on the tiny fixtures in tests/fixtures/hf (made by make_fixtures.py).

Logits are compared in float32 at valid (non-pad) positions: max abs diff < 1e-4 (f32 rounding
of two implementations of the same math; measured ~5e-6). Greedy generation uses our KV cache
(prefill + one-token decode steps) and must reproduce transformers' tokens and step logits.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation.kv import init_cache
from fp8rl_jax.models import (
    ModelConfig,
    forward,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
MODELS = sorted(
    d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "references.npz"))
) if os.path.isdir(ROOT) else []  # fmt: skip
pytestmark = pytest.mark.skipif(not MODELS, reason="no HF fixtures")
fwd = jax.jit(forward, static_argnames=("cfg", "return_qkv_amax", "return_hidden"))


def load(name, dtype=jnp.float32):
    cfg, w = load_hf_checkpoint(os.path.join(ROOT, name), dtype=dtype)
    return cfg, w, np.load(os.path.join(ROOT, name, "references.npz"))


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name):
    cfg, w, ref = load(name)
    out = fwd(
        w,
        jnp.asarray(ref["tokens"]),
        cfg,
        positions_BT=jnp.asarray(ref["position_ids"]),
        segment_ids_BT=jnp.asarray(ref["attention_mask"]),
    )
    valid = ref["attention_mask"].astype(bool)
    diff = np.abs(np.asarray(out.logits_BTV) - ref["logits"])[valid]
    assert diff.max() < 1e-4, diff.max()


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_with_cache_matches_transformers(name):
    cfg, w, ref = load(name)
    prompt, mask = jnp.asarray(ref["gen_prompt"]), jnp.asarray(ref["gen_mask"])
    B, P = prompt.shape
    n_new = ref["gen_logits"].shape[1]
    pos = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
    cache = init_cache(cfg, B, P + n_new, dtype=jnp.float32)
    out = fwd(w, prompt, cfg, positions_BT=pos, segment_ids_BT=mask, cache=cache)
    last, next_pos, steps, toks = out.logits_BTV[:, -1], pos[:, -1:] + 1, [], []
    for _ in range(n_new):
        steps.append(last)
        tok = jnp.argmax(last, -1)[:, None].astype(jnp.int32)
        toks.append(tok)
        out = fwd(w, tok, cfg, positions_BT=next_pos, cache=out.cache)
        last, next_pos = out.logits_BTV[:, -1], next_pos + 1
    np.testing.assert_array_equal(jnp.concatenate(toks, 1), ref["gen_tokens"][:, P:])
    assert np.abs(np.stack(steps, 1) - ref["gen_logits"]).max() < 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_v4_and_v5_configs_parse_identically(name):
    v5 = ModelConfig.from_hf_config(os.path.join(ROOT, name))
    assert ModelConfig.from_hf_config(os.path.join(ROOT, name, "config_v4.json")) == v5
    assert ModelConfig.from_hf_config(v5.to_hf_config()) == v5


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_load_save_load_round_trip_is_exact(name, dtype, tmp_path):
    cfg, w = load_hf_checkpoint(os.path.join(ROOT, name), dtype=dtype)
    out = tmp_path / "ckpt"
    save_hf_checkpoint(out, cfg, w, max_shard_bytes=40_000)
    cfg2, w2 = load_hf_checkpoint(out, dtype=dtype)
    assert cfg2 == cfg
    assert jax.tree.structure(w2) == jax.tree.structure(w)
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(w2), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if dtype == jnp.float32:  # same tensor names and shapes as transformers wrote
        with open(os.path.join(ROOT, "MANIFEST.json")) as f:
            hf = json.load(f)["models"][name]["tensors"]
        ours = _tensor_shapes(out)
        assert ours == {k: tuple(v["shape"]) for k, v in hf.items()}


def _tensor_shapes(path):
    from safetensors import safe_open

    shapes = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="numpy") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})  # noqa: SIM118
    return shapes
