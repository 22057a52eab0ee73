"""Block-FP8 export (models/hf_fp8.py): the DeepSeek-V3 / vLLM layout, and it round-trips.

The exported rollout policy, read back by our loader, gives bit-identical logits to the
in-memory FP8 rollout weights it came from (same FP8 values, same scales, same BF16 rest).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.generation import RolloutConfig, rollout_weights
from fp8rl_jax.models import (
    CheckpointError,
    ModelConfig,
    forward,
    init_weights,
    load_fp8_checkpoint,
    load_hf_checkpoint,
    save_fp8_checkpoint,
)
from fp8rl_jax.models.hf.layout import _read_safetensors
from fp8rl_jax.quant import QuantRecipe
from kernels_pallas.qarray import QArray, dequantize_weight

FIX = Path(__file__).resolve().parent / "fixtures" / "hf"
TOKENS = jnp.array([[1, 5, 9, 17, 33, 60, 2, 7]], jnp.int32)


def _is_q(x):
    return isinstance(x, QArray)


def _logits(weights, cfg):
    return np.asarray(jax.jit(lambda w: forward(w, TOKENS, cfg).logits_BTV)(weights))


def _export(tmp_path, cfg, params, recipe=None, extra=None):
    weights, _ = rollout_weights(params, RolloutConfig(quant=recipe or QuantRecipe()))
    out = tmp_path / "fp8"
    save_fp8_checkpoint(out, cfg, weights, extra_files_from=extra)
    return weights, out


def _assert_same_weights(a, b):
    la, ta = jax.tree.flatten(a, is_leaf=_is_q)
    lb, tb = jax.tree.flatten(b, is_leaf=_is_q)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert _is_q(x) == _is_q(y)
        if _is_q(x):
            assert x.block_shape == y.block_shape and x.values.dtype == y.values.dtype
            np.testing.assert_array_equal(
                np.asarray(x.values, np.float32), np.asarray(y.values, np.float32)
            )
            np.testing.assert_array_equal(x.scales, y.scales)
        else:
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_fixture_export_round_trips_to_identical_logits(tmp_path, name):
    cfg, params = load_hf_checkpoint(FIX / name, dtype=jnp.float32)
    weights, out = _export(tmp_path, cfg, params, extra=FIX / name)
    cfg2, loaded = load_fp8_checkpoint(out)
    assert cfg2 == cfg
    _assert_same_weights(weights, loaded)
    np.testing.assert_array_equal(_logits(loaded, cfg2), _logits(weights, cfg))  # bit-identical
    assert (out / "generation_config.json").exists()


def test_file_layout_is_deepseek_v3_block_fp8(tmp_path):
    cfg, params = load_hf_checkpoint(FIX / "qwen3_moe", dtype=jnp.float32)
    weights, out = _export(tmp_path, cfg, params)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(_read_safetensors(str(f)))
    fp8 = ml_dtypes.float8_e4m3fn
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == fp8 and q.shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)  # [N, K]
    s = tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert s.dtype == np.float32 and s.shape == (1, 1)
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == fp8
    # kept high precision, in BF16, without scales: embeddings, lm_head, norms, the MoE router
    bf16 = ml_dtypes.bfloat16
    for kept in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate.weight",
    ):
        assert tensors[kept].dtype == bf16, kept
        assert kept + "_scale_inv" not in tensors
    # weight_scale_inv is the dequantization multiplier: W ≈ weight · weight_scale_inv, within
    # half an E4M3 step at the top binade (16 · scale) of the BF16 weight the rollout quantized
    w_KN = params["layers"][0]["attn"]["wq"].astype(jnp.bfloat16).astype(jnp.float32)
    err = np.abs(q.astype(np.float32) * s[0, 0] - np.asarray(w_KN).T)
    assert err.max() <= 16 * s[0, 0] and err.max() > 0


def test_multi_block_weights_and_kept_layers(tmp_path):
    # 2 x 3 blocks of 128 (one partial) per matrix; layer 0 kept BF16 by the recipe
    cfg = ModelConfig(
        vocab_size=64, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
        intermediate_size=320, qk_norm=True, architecture="Qwen3ForCausalLM",
    )  # fmt: skip
    params = init_weights(cfg, jax.random.key(0), jnp.float32)
    params["embed"] = params["embed"] / 16.0
    weights, out = _export(tmp_path, cfg, params, QuantRecipe(keep_first_n=1))
    assert weights["layers"][1]["mlp"]["w_gate"].scales.shape == (3, 2)  # [N/128, K/128]
    config = json.loads((out / "config.json").read_text())
    ignored = config["quantization_config"]["ignored_layers"]
    assert (
        "model.layers.0.self_attn.q_proj" in ignored and "model.layers.0.mlp.down_proj" in ignored
    )
    assert not any(m.startswith("model.layers.1.") for m in ignored)
    cfg2, loaded = load_fp8_checkpoint(out)
    _assert_same_weights(weights, loaded)
    np.testing.assert_array_equal(_logits(loaded, cfg2), _logits(weights, cfg))
    # the training loader dequantizes: weight · weight_scale_inv in the [K, N] layout
    _, dense = load_hf_checkpoint(out, dtype=jnp.float32)
    want = dequantize_weight(weights["layers"][1]["mlp"]["w_gate"], jnp.float32)
    np.testing.assert_array_equal(dense["layers"][1]["mlp"]["w_gate"], want)


def test_missing_scale_is_an_error(tmp_path):
    cfg, params = load_hf_checkpoint(FIX / "qwen3", dtype=jnp.float32)
    _, out = _export(tmp_path, cfg, params)
    from safetensors.numpy import save_file

    tensors = _read_safetensors(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file({k: np.array(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight_scale_inv"):
        load_fp8_checkpoint(out)
