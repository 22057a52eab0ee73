"""Block-FP8 export (models/hf/fp8.py): the DeepSeek-V3 / vLLM layout, and it round-trips.

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
# The fixtures' sizes (D=64, q 64, k/v 32, F 128, experts 32) are whole 32-blocks: servable.
FIXTURE_RECIPE = QuantRecipe(weight_block=(32, 32), act_group=32)


def _is_q(x):
    return isinstance(x, QArray)


def _logits(weights, cfg):
    return np.asarray(jax.jit(lambda w: forward(w, TOKENS, cfg).logits_BTV)(weights))


def _export(tmp_path, cfg, params, recipe=None, extra=None):
    weights, _ = rollout_weights(params, RolloutConfig(quant=recipe or FIXTURE_RECIPE))
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
        "weight_block_size": [32, 32],
        "ignored_layers": ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"],  # routers
    }
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(_read_safetensors(str(f)))
    fp8 = ml_dtypes.float8_e4m3fn
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == fp8 and q.shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)  # [N, K]
    s = tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert s.dtype == np.float32 and s.shape == (2, 2)
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
    err = np.abs(q[:32, :32].astype(np.float32) * s[0, 0] - np.asarray(w_KN).T[:32, :32])
    assert err.max() <= 16 * s[0, 0] and err.max() > 0


def test_multi_block_weights_and_kept_layers(tmp_path):
    # 2 x 3 blocks of 128 per matrix; layer 0 kept BF16 by the recipe
    cfg = ModelConfig(
        vocab_size=64, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
        intermediate_size=384, qk_norm=True, architecture="Qwen3ForCausalLM",
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
    assert "model.layers.0.self_attn.qkv_proj" in ignored  # SGLang's fused name
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


def _quantize_block_fp8(w_NK, block):
    """DeepSeek-V3 ``weight_dequant``'s inverse in numpy: per-block amax / 448 scales, ceil grid."""
    bn, bk = block
    N, K = w_NK.shape
    s = np.zeros((-(-N // bn), -(-K // bk)), np.float32)
    q = np.zeros((N, K), ml_dtypes.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w_NK[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s[i, j] = max(np.abs(blk).max(), 1e-12) / 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s[i, j]).astype(q.dtype)
    return q, s


def _weight_dequant(q, s, block):
    """DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``: y[n, k] = x[n, k] s[n//bn, k//bk]."""
    rows = np.repeat(s, block[0], 0)[: q.shape[0]]
    return q.astype(np.float32) * np.repeat(rows, block[1], 1)[:, : q.shape[1]]


def _foreign_fp8_checkpoint(tmp_path, block, ignored):
    """A Qwen3 block-FP8 checkpoint as another tool writes it (numpy, DeepSeek-V3 layout)."""
    from safetensors.numpy import save_file

    src = FIX / "qwen3"
    tensors = _read_safetensors(str(src / "model.safetensors"))
    out, want = {}, {}
    for name, w in tensors.items():
        w = np.asarray(w, np.float32)
        module = name.rsplit(".", 1)[0]
        linear = name.endswith("_proj.weight")
        if linear and module not in ignored:
            q, s = _quantize_block_fp8(w, block)
            out[name], out[name + "_scale_inv"] = q, s
            want[name] = _weight_dequant(q, s, block)
        else:
            out[name] = w.astype(ml_dtypes.bfloat16)
            want[name] = out[name].astype(np.float32)
    dst = tmp_path / "foreign"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block), "ignored_layers": sorted(ignored),
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst, want


@pytest.mark.parametrize("block", [(128, 128), (32, 16)])  # one partial block; whole blocks
def test_foreign_block_fp8_checkpoint_loads_dequantized_as_a_start_point(tmp_path, block):
    a = "model.layers.0.self_attn"
    ignored = {f"{a}.{p}_proj" for p in "qkv"} | {f"{a}.qkv_proj", "lm_head"}
    path, want = _foreign_fp8_checkpoint(tmp_path, block, ignored)
    cfg, w = load_hf_checkpoint(path, dtype=jnp.float32)  # the training start point
    ref_cfg, ref = load_hf_checkpoint(FIX / "qwen3", dtype=jnp.float32)
    assert cfg == ref_cfg
    layer0, layer1 = w["layers"][0], w["layers"][1]
    # listed in ignored_layers: BF16 on disk, loaded as is
    np.testing.assert_array_equal(layer0["attn"]["wq"], want[f"{a}.q_proj.weight"].T)
    np.testing.assert_array_equal(
        layer0["attn"]["wq"], np.asarray(ref["layers"][0]["attn"]["wq"], ml_dtypes.bfloat16)
    )
    # FP8: weight · weight_scale_inv, DeepSeek-V3's rule, in our [K, N] layout
    for ours, hf in (("wo", "self_attn.o_proj"), ("wk", "self_attn.k_proj")):
        np.testing.assert_array_equal(layer1["attn"][ours], want[f"model.layers.1.{hf}.weight"].T)
    np.testing.assert_array_equal(
        layer0["mlp"]["w_down"], want["model.layers.0.mlp.down_proj.weight"].T
    )
    err = np.abs(np.asarray(layer1["mlp"]["w_up"]) - np.asarray(ref["layers"][1]["mlp"]["w_up"]))
    assert 0 < err.max() < 0.1 * np.abs(np.asarray(ref["layers"][1]["mlp"]["w_up"])).max()
    logits = _logits(w, cfg)
    assert np.all(np.isfinite(logits))


def test_foreign_checkpoint_with_an_fp8_tensor_it_says_is_ignored_is_refused(tmp_path):
    path, _ = _foreign_fp8_checkpoint(tmp_path, (32, 32), set())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["model.layers.1.mlp.up_proj"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj.*ignored_layers"):
        load_hf_checkpoint(path, dtype=jnp.float32)
