"""Fused rollout projections (``models.fused``): q|k|v and gate|up as one FP8 GEMM each.

Fusing must not change what the rollout computes: the fused QArray is the separate QArrays'
values and scales rearranged (checked block for block against the hand-built layout), and the
forward pass and the rollout engines give the same logits and tokens either way. Sharded
behaviour (whole KV groups per tensor shard, no added collectives) is in
``test_sharding_mesh.py``; the specs on an abstract mesh are here.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fp8rl_jax.generation import RolloutConfig, SamplingConfig, rollout, rollout_weights
from fp8rl_jax.generation.config import PagedConfig
from fp8rl_jax.models import ModelConfig, forward, init_weights
from fp8rl_jax.models.fused import (
    GATE_UP,
    QKV,
    fuse_projections,
    split_gate_up,
    split_qkv,
)
from fp8rl_jax.quant import QArray, QuantRecipe, quantize_params
from fp8rl_jax.train import sharding as sh
from kernels_pallas.qarray import dequantize

# G = 2 query heads per KV head, head_dim one 128-block, F two blocks.
CFG = ModelConfig(vocab_size=64, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=128, intermediate_size=256, qk_norm=True,
                  architecture="Qwen3ForCausalLM")  # fmt: skip


def _quantized(cfg=CFG, recipe=None):
    w = init_weights(cfg, jax.random.key(0), jnp.float32, randomize_all=True)
    return quantize_params(w, recipe or QuantRecipe())


def _deq(q: QArray) -> np.ndarray:
    return np.asarray(dequantize(q), np.float32)


def test_fused_layout_is_the_parts_regrouped_block_for_block():
    """wqkv rows: per KV head g, its G query heads, k_g, v_g; w_gate_up rows: gate block j
    then up block j. Values and scales move together, so dequantized rows match exactly."""
    q = _quantized()
    f = fuse_projections(q, CFG)
    attn, mlp = q["layers"][0]["attn"], q["layers"][0]["mlp"]
    fa, fm = f["layers"][0]["attn"], f["layers"][0]["mlp"]
    assert set(fa) == {"wo", QKV, "q_norm", "k_norm"} and set(fm) == {"w_down", GATE_UP}
    C, G = CFG.head_dim, CFG.num_heads // CFG.num_kv_heads
    wq, wk, wv = (_deq(attn[n]) for n in ("wq", "wk", "wv"))
    rows = lambda w, g, n: w[g * n * C : (g + 1) * n * C]  # group g's n heads of C rows
    want = np.concatenate([np.concatenate([rows(wq, g, G), rows(wk, g, 1), rows(wv, g, 1)])
                           for g in range(CFG.num_kv_heads)])  # fmt: skip
    assert fa[QKV].shape == (CFG.num_kv_heads * (G + 2) * C, CFG.hidden_size)
    np.testing.assert_array_equal(_deq(fa[QKV]), want)
    gate, up = _deq(mlp["w_gate"]), _deq(mlp["w_up"])
    b = 128
    want = np.concatenate([np.concatenate([gate[j:j + b], up[j:j + b]])
                           for j in range(0, CFG.intermediate_size, b)])  # fmt: skip
    np.testing.assert_array_equal(_deq(fm[GATE_UP]), want)


def test_split_inverts_the_fused_row_order():
    """split_qkv / split_gate_up on the fused rows' indices give each part's own indices."""
    K, C, G, F = CFG.num_kv_heads, CFG.head_dim, CFG.num_heads // CFG.num_kv_heads, 512
    rows = jnp.arange(K * (G + 2) * C, dtype=jnp.float32)[None]
    q, k, v = split_qkv(rows, CFG)
    assert q.shape == (1, CFG.num_heads, C) and k.shape == v.shape == (1, K, C)
    # query head 2 (group 1, first of its 2) starts the second group's rows
    assert float(q[0, 2, 0]) == (G + 2) * C and float(k[0, 0, 0]) == G * C
    assert float(v[0, 1, 5]) == (G + 2) * C + (G + 1) * C + 5
    gate, up = split_gate_up(jnp.arange(2 * F, dtype=jnp.float32)[None], 128)
    np.testing.assert_array_equal(gate[0, 128:130], [256, 257])
    np.testing.assert_array_equal(up[0, :2], [128, 129])


@pytest.mark.parametrize("variant", ["qwen3_qk_norm", "qwen2_qkv_bias"])
def test_forward_is_unchanged_by_fusion(variant):
    cfg = CFG if variant == "qwen3_qk_norm" else dataclasses.replace(
        CFG, qk_norm=False, qkv_bias=True, architecture="Qwen2ForCausalLM")  # fmt: skip
    q = _quantized(cfg)
    f = fuse_projections(q, cfg)
    assert QKV in f["layers"][1]["attn"] and GATE_UP in f["layers"][1]["mlp"]
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    a = forward(q, tokens, cfg).logits_BTV
    b = forward(f, tokens, cfg).logits_BTV
    assert float(jnp.max(jnp.abs(a))) > 0.5
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_only_block_aligned_quantized_projections_fuse(caplog):
    # BF16 rollout: nothing is a QArray, the tree is returned as it came
    w = init_weights(CFG, jax.random.key(0), jnp.float32)
    assert fuse_projections(w, CFG) is w
    # head_dim 64 < the 128-row block: q|k|v stay separate, gate|up (F = 256) still fuse
    cfg = dataclasses.replace(CFG, head_dim=64)
    f = fuse_projections(_quantized(cfg), cfg)
    assert {"wq", "wk", "wv"} <= set(f["layers"][0]["attn"]) and QKV not in f["layers"][0]["attn"]
    assert GATE_UP in f["layers"][0]["mlp"]
    # per-tensor scales: wq's one block is [H·C, D], wk's [K·C, D]: q|k|v stay separate;
    # gate and up have equal blocks (one each) and fuse, keeping their own scale
    q = _quantized(recipe=QuantRecipe(per_tensor=True))
    f = fuse_projections(q, CFG)
    assert QKV not in f["layers"][0]["attn"] and GATE_UP in f["layers"][0]["mlp"]
    assert f["layers"][0]["mlp"][GATE_UP].scales.shape == (2, 1)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab_size)
    np.testing.assert_allclose(
        forward(f, tokens, CFG).logits_BTV, forward(q, tokens, CFG).logits_BTV, rtol=0, atol=1e-6
    )
    # a layer kept in BF16 (keep_first_n) stays as it is; the quantized one fuses
    f = fuse_projections(_quantized(recipe=QuantRecipe(keep_first_n=1)), CFG)
    assert "wq" in f["layers"][0]["attn"] and QKV in f["layers"][1]["attn"]
    # MoE experts (grouped_fp8_matmul fuses them itself) stay; their attention fuses
    moe = dataclasses.replace(CFG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                              architecture="Qwen3MoeForCausalLM")  # fmt: skip
    f = fuse_projections(_quantized(moe), moe)
    assert QKV in f["layers"][0]["attn"] and "w_gate" in f["layers"][0]["mlp"]


def _prompts():
    from fp8rl_jax.generation import Prompts

    toks = np.zeros((4, 6), np.int32)
    lens = np.array([6, 3, 5, 1], np.int32)
    rng = np.random.default_rng(0)
    for i, n in enumerate(lens):
        toks[i, 6 - n :] = rng.integers(1, CFG.vocab_size, n)
    return Prompts(jnp.asarray(toks), jnp.asarray(lens))


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_rollout_engines_give_the_same_tokens_fused_or_not(engine):
    params = init_weights(CFG, jax.random.key(0), jnp.float32, randomize_all=True)
    paged = PagedConfig(num_slots=4, page_size=4, prefill_batch=2)
    base = RolloutConfig(max_new_tokens=5, engine=engine, paged=paged,
                         sampling=SamplingConfig(temperature=1.0))  # fmt: skip
    seen = []

    def pin(w):
        seen.append(w)
        return w

    out, last = {}, {}
    for fuse in (True, False):
        rc = dataclasses.replace(base, fuse_projections=fuse)
        out[fuse], _ = rollout(params, _prompts(), CFG, rc, jax.random.key(3), pin=pin)
        last[fuse] = seen[-1]  # the engine's weights: pinned, fused, pinned again
    assert len(seen) == 3  # twice with fusion (before and after it), once without
    assert QKV in last[True]["layers"][0]["attn"] and "wq" in last[False]["layers"][0]["attn"]
    np.testing.assert_array_equal(out[True].tokens_BT, out[False].tokens_BT)
    np.testing.assert_allclose(out[True].logp_BT, out[False].logp_BT, rtol=0, atol=1e-6)


def test_export_copy_keeps_the_checkpoint_layout():
    """rollout_weights without ``fuse_for`` (what train.export writes) is not fused."""
    params = init_weights(CFG, jax.random.key(0), jnp.float32)
    w, _ = rollout_weights(params, RolloutConfig())
    assert "wq" in w["layers"][0]["attn"] and "w_gate" in w["layers"][0]["mlp"]
    w, _ = rollout_weights(params, RolloutConfig(), fuse_for=CFG)
    assert QKV in w["layers"][0]["attn"] and GATE_UP in w["layers"][0]["mlp"]


def _fused_specs(tensor: int):
    w = jax.eval_shape(lambda: fuse_projections(_quantized(), CFG))
    mesh = sh.abstract_mesh(sh.MeshConfig(data=8 // tensor, tensor=tensor), 8)
    s = sh.param_shardings(w, CFG, mesh, sh.ROLLOUT_RULES)
    return s["layers"][0]["attn"][QKV], s["layers"][0]["mlp"][GATE_UP]


def test_fused_weights_shard_in_whole_kv_groups_and_block_pairs(caplog):
    qkv, gate_up = _fused_specs(2)  # 2 KV groups, 2 (gate, up) block pairs: one each per shard
    assert qkv.values.spec == qkv.scales.spec == P("tensor", None)
    assert gate_up.values.spec == gate_up.scales.spec == P("tensor", None)
    # 4 shards would cut a KV group (and a block pair) in half: those dims replicate instead
    with caplog.at_level(logging.WARNING):
        qkv, gate_up = _fused_specs(4)
    assert qkv.values.spec == P(None, None) and gate_up.values.spec == P(None, None)
    assert "qkv_groups" in caplog.text


@pytest.mark.parametrize("fuse", [True, False])
def test_producers_quantizing_change_no_bit(fuse, monkeypatch):
    """W8A8 layers get their input quantized by its producer (RMSNorm, SiLU product, the decode
    attention's output: one kernel launch each on Hopper, ``models.layers``). On CPU that is the
    same math as the GEMM quantizing it: prefill and a cached decode step give the same logits
    bit for bit as with every producer forced plain."""
    from fp8rl_jax.generation.kv.dense import init_cache
    from fp8rl_jax.models import layers
    from kernels_pallas.backend import KernelImpls

    q = _quantized()
    w = fuse_projections(q, CFG) if fuse else q
    toks = jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab_size)
    kernels = KernelImpls(decode_attention="xla")
    calls = []
    wrapped = layers.rmsnorm_quantize
    monkeypatch.setattr(
        layers, "rmsnorm_quantize", lambda *a, **k: calls.append(1) or wrapped(*a, **k)
    )

    def run():
        cache = init_cache(CFG, 2, 16, dtype=jnp.float8_e4m3fn, mode="static",
                           k_scale=jnp.full((2,), 0.05), v_scale=jnp.full((2,), 0.05))  # fmt: skip
        pre = forward(w, toks[:, :7], CFG, cache=cache, kernels=kernels)
        step = forward(w, toks[:, 7:], CFG, cache=pre.cache, kernels=kernels)
        return pre.logits_BTV, step.logits_BTV

    got = run()
    assert len(calls) == 2 * 2 * CFG.num_layers  # two norms per layer, prefill and decode
    monkeypatch.setattr(layers, "fp8_input_dtype", lambda *ws: None)  # every producer's
    want = run()
    assert float(jnp.max(jnp.abs(want[1]))) > 0.5
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_producers_hand_hopper_decode_gemms_of_16_rows_raw_x(monkeypatch):
    """On Hopper the FP8 GEMMs of a 16-row decode step take raw BF16 x (the fused kernel's
    16-row tiles, quantized in-kernel) instead of FP8 x padded to 32 rows by two XLA launches
    each: ``producer_dtype`` is None there, the FP8 format at every other row count, on every
    other target and with the XLA matmul."""
    import types

    from fp8rl_jax.models import layers
    from kernels_pallas.act_quantize import api

    w = _quantized()["layers"][0]["attn"]["wq"]
    fp8 = w.values.dtype
    x16, x32 = jnp.zeros((16, 1, CFG.hidden_size)), jnp.zeros((32, CFG.hidden_size))
    assert layers.producer_dtype(x16, w) == fp8  # CPU: the producers quantize
    monkeypatch.setattr(api, "target_device", lambda: types.SimpleNamespace(is_hopper=True))
    assert layers.producer_dtype(x16, w) is None
    assert layers.producer_dtype(x32, w) == fp8
    assert layers.producer_dtype(x16, w, impl="xla") == fp8
    assert layers.producer_dtype(x16, w, jnp.zeros((4, 4))) is None  # a BF16 consumer: raw
    monkeypatch.setenv("FP8RL_FUSED_X", "0")  # the switch: producers quantize, x never fused
    assert layers.producer_dtype(x16, w) == fp8
    from kernels_pallas.fp8_matmul import api as mm_api

    assert not mm_api.fused_default(16, 4096, 4096, "h100")
