"""MoE: dropless ragged experts vs the dense reference, FP8 experts, load-balancing loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation.kv import init_cache
from fp8rl_jax.models import ModelConfig, forward, init_weights
from fp8rl_jax.models.moe import moe_mlp, moe_mlp_dense_reference, route
from fp8rl_jax.models.presets import QWEN3_30B_A3B
from fp8rl_jax.quant import QArray, QuantRecipe, quantize_params
from kernels_pallas import KernelImpls

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
    architecture="Qwen3MoeForCausalLM",
)
fwd = jax.jit(forward, static_argnames=("cfg", "return_qkv_amax", "return_hidden"))


@functools.cache
def weights(dtype=jnp.float32):
    return init_weights(CFG, jax.random.key(0), dtype, randomize_all=True)


def x_BTD(dtype=jnp.float32):
    return jax.random.normal(jax.random.key(1), (2, 5, CFG.hidden_size)).astype(dtype)


def test_layer_kinds():
    w = weights()
    assert set(w["layers"][0]["mlp"]) == {"router", "w_gate", "w_up", "w_down"}
    assert w["layers"][0]["mlp"]["w_down"].shape == (4, 32, 64)
    assert set(w["layers"][1]["mlp"]) == {"w_gate", "w_up", "w_down"}


@pytest.mark.parametrize("norm_topk", [True, False])
def test_ragged_equals_dense_reference_f32(norm_topk):
    cfg = ModelConfig(**{**CFG.__dict__, "norm_topk_prob": norm_topk})
    p = weights()["layers"][0]["mlp"]
    x = x_BTD()
    y, _ = moe_mlp(p, x, jnp.ones(x.shape[:2], bool), cfg)
    np.testing.assert_allclose(y, moe_mlp_dense_reference(p, x, cfg), atol=1e-5, rtol=1e-5)


def test_ragged_equals_dense_reference_bf16():
    """BF16 experts: ragged vs f32 dense reference within bf16 rounding (2^-8 relative)."""
    p = weights(jnp.bfloat16)["layers"][0]["mlp"]
    x = x_BTD(jnp.bfloat16)
    y, _ = moe_mlp(p, x, jnp.ones(x.shape[:2], bool), CFG)
    ref = moe_mlp_dense_reference(p, x, CFG).astype(jnp.float32)
    np.testing.assert_allclose(y.astype(jnp.float32), ref, atol=3e-2, rtol=3e-2)


def test_fp8_experts_equal_dense_reference_with_dequantized_weights():
    """QArray [E, out, in] experts (K-major, per-expert 128x128 blocks): W8A8 ragged == dense
    W8A8 (f32), and both close to the high-precision experts (which a transposed use is not)."""
    hp = weights()["layers"][0]["mlp"]
    p = quantize_params(weights(), QuantRecipe())["layers"][0]["mlp"]
    assert isinstance(p["w_gate"], QArray) and p["w_gate"].scales.shape == (4, 1, 1)
    assert p["w_gate"].shape == (hp["w_gate"].shape[0], *hp["w_gate"].shape[:0:-1])
    assert not isinstance(p["router"], QArray)
    x = x_BTD()
    y, _ = moe_mlp(p, x, jnp.ones(x.shape[:2], bool), CFG)
    np.testing.assert_allclose(y, moe_mlp_dense_reference(p, x, CFG), atol=1e-5, rtol=1e-5)
    y_hp, _ = moe_mlp(weights()["layers"][0]["mlp"], x, jnp.ones(x.shape[:2], bool), CFG)
    rel = float(jnp.linalg.norm(y - y_hp) / jnp.linalg.norm(y_hp))
    assert 0 < rel < 0.1  # E4M3 on weights and activations: a few percent


def test_routing_weights_are_renormalized_top_k_probs():
    p = weights()["layers"][0]["mlp"]
    x = x_BTD().reshape(-1, CFG.hidden_size)
    top_w, top_i, probs = route(x, p["router"], CFG)
    top_p = np.asarray(jnp.take_along_axis(probs, top_i, -1))
    assert (top_p.min(-1) >= np.sort(np.asarray(probs), -1)[:, -2] - 1e-7).all()
    np.testing.assert_allclose(top_w, top_p / top_p.sum(-1, keepdims=True), rtol=1e-6)


def test_aux_loss_uniform_router_equals_top_k():
    """Zero router: P_e = 1/E, the first k experts get every token (f_e = 1): E·Σ f·P = k."""
    w = weights()
    w = {**w, "layers": [dict(lp) for lp in w["layers"]]}
    w["layers"][0]["mlp"] = {**w["layers"][0]["mlp"], "router": jnp.zeros((64, 4))}
    t = jnp.ones((2, 5), jnp.int32)
    assert float(fwd(w, t, CFG).aux_loss) == pytest.approx(CFG.num_experts_per_tok, rel=1e-6)


def test_aux_loss_formula_with_padding():
    """E · Σ_e f_e P_e over valid tokens only (HF load_balancing_loss_func with a mask)."""
    w = weights()
    t = jax.random.randint(jax.random.key(2), (2, 6), 1, 128)
    seg = jnp.array([[0, 0, 1, 1, 1, 1], [1] * 6])
    out = fwd(w, t, CFG, segment_ids_BT=seg, return_hidden=True)
    # Recompute layer 0's MoE input: the dense check runs the model up to that norm.
    from fp8rl_jax.models.layers import rms_norm
    from fp8rl_jax.models.rope import rope_cos_sin
    from fp8rl_jax.models.transformer import _attention, _Inputs, _uncached

    step = _uncached(seg)
    cos, sin = rope_cos_sin(step.positions_BT, CFG.rope, CFG.head_dim, w["embed"].dtype)
    inp = _Inputs(CFG, KernelImpls(), step, cos, sin, seg != 0, False)
    lp = w["layers"][0]
    x = w["embed"][t]
    x = x + _attention(lp["attn"], rms_norm(x, lp["attn_norm"], 1e-6), 0, inp)[0]
    h = rms_norm(x, lp["mlp_norm"], 1e-6).reshape(-1, 64)
    logits = np.asarray(h @ lp["mlp"]["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[:, :2]
    m = np.asarray(seg, bool).reshape(-1)
    f = np.zeros(4)
    np.add.at(f, top[m].reshape(-1), 1.0)
    f /= m.sum()
    P = probs[m].mean(0)
    assert float(out.aux_loss) == pytest.approx(4 * np.sum(f * P), rel=1e-4)


def test_moe_cached_decode_and_padding():
    w = weights()
    t = jax.random.randint(jax.random.key(3), (2, 7), 1, 128)
    seg = jnp.array([[0] + [1] * 6, [1] * 7])
    pos = jnp.maximum(jnp.cumsum(seg, -1) - 1, 0)
    full = fwd(w, t, CFG, positions_BT=pos, segment_ids_BT=seg).logits_BTV
    cache = init_cache(CFG, 2, 8, dtype=jnp.float32)
    out = fwd(w, t[:, :5], CFG, positions_BT=pos[:, :5], segment_ids_BT=seg[:, :5], cache=cache)
    logits = [out.logits_BTV]
    for i in (5, 6):
        s = slice(i, i + 1)
        out = fwd(
            w, t[:, s], CFG, positions_BT=pos[:, s], segment_ids_BT=seg[:, s], cache=out.cache
        )
        logits.append(out.logits_BTV)
    dec = jnp.concatenate(logits, 1)
    assert np.abs(np.asarray(dec - full))[np.asarray(seg, bool)].max() < 1e-4
    alone = fwd(w, t[:1, 1:], CFG).logits_BTV[0]
    np.testing.assert_allclose(full[0, 1:], alone, atol=1e-5)


def test_ragged_gradients_equal_dense_reference_gradients():
    """The trainer differentiates the ragged path: its grads match the dense reference's."""
    p = weights()["layers"][0]["mlp"]
    x = x_BTD()
    ones = jnp.ones(x.shape[:2], bool)
    g_ragged = jax.grad(lambda p: jnp.sum(jnp.sin(moe_mlp(p, x, ones, CFG)[0])))(p)
    g_dense = jax.grad(lambda p: jnp.sum(jnp.sin(moe_mlp_dense_reference(p, x, CFG))))(p)
    for k in ("w_gate", "w_up", "w_down", "router"):
        np.testing.assert_allclose(g_ragged[k], g_dense[k], atol=1e-5, rtol=1e-4, err_msg=k)


# ---------------------------------------------------------------- FP8 rollout experts

# D and F multiples of 128, so the Mosaic kernels' support checks accept the expert GEMMs.
CFG_128 = ModelConfig(**{**CFG.__dict__, "hidden_size": 128, "moe_intermediate_size": 128})


def _blocked_dims(q: QArray) -> tuple[int, ...]:
    return q.shape[q.ndim - len(q.block_shape) :]


@pytest.mark.parametrize("cfg", [CFG, QWEN3_30B_A3B], ids=["tiny", "qwen3-30b-a3b"])
def test_router_is_never_quantized(cfg):
    """By name (every ``router`` leaf stays an f32/bf16 array) and by shape (no QArray has the
    expert count among its blocked [N, K] dims, as a renamed router [D, E] -> [E, D] would):
    the rollout copy of the tiny model and, abstractly, of Qwen3-30B-A3B."""
    w = jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0), jnp.bfloat16))
    wq = jax.eval_shape(lambda w: quantize_params(w, QuantRecipe()), w)
    flat = jax.tree_util.tree_flatten_with_path(wq, is_leaf=lambda x: isinstance(x, QArray))[0]
    routers = [(p, x) for p, x in flat if "router" in jax.tree_util.keystr(p)]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert len(routers) == moe_layers > 0
    for _, r in routers:
        assert not isinstance(r, QArray)
        assert r.dtype == jnp.bfloat16 and r.shape == (cfg.hidden_size, cfg.num_experts)
    quantized = [x for _, x in flat if isinstance(x, QArray)]
    assert quantized and all(cfg.num_experts not in _blocked_dims(q) for q in quantized)


def test_quantized_router_is_an_error():
    """A recipe that does not exclude the router would quantize it: the MoE layer refuses."""
    wq = quantize_params(weights(), QuantRecipe(exclude=("embed", "lm_head", "norm")))
    assert isinstance(wq["layers"][0]["mlp"]["router"], QArray)
    with pytest.raises(TypeError, match="router stays high precision"):
        fwd(wq, jnp.ones((1, 3), jnp.int32), CFG)


def test_fp8_experts_run_the_grouped_kernel(monkeypatch):
    """Under an (abstract) H100 with forced interpret mode, ``auto`` runs gate+up (one call over
    both stacks) and down through the Mosaic GPU grouped kernel, and the layer equals the dense
    W8A8 reference."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.sharding import AbstractDevice, AbstractMesh

    from kernels_pallas.grouped_fp8_matmul import IMPLEMENTATIONS

    chosen = []
    select = IMPLEMENTATIONS.select
    monkeypatch.setattr(
        IMPLEMENTATIONS, "select", lambda *a, **k: chosen.append(select(*a, **k)) or chosen[-1]
    )
    w = init_weights(CFG_128, jax.random.key(4), jnp.float32)
    p = quantize_params(w, QuantRecipe())["layers"][0]["mlp"]
    x = jax.random.normal(jax.random.key(5), (1, 2, 128))
    h100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    mesh = AbstractMesh((), (), abstract_device=h100)
    with (
        jax.sharding.use_abstract_mesh(mesh),
        plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()),
    ):
        y, _ = moe_mlp(p, x, jnp.ones((1, 2), bool), CFG_128)
    assert [c.name for c in chosen] == ["pallas_mosaic_gpu"] * 2
    ref = moe_mlp_dense_reference(p, x, CFG_128)
    np.testing.assert_allclose(y, ref, atol=1e-5 * float(jnp.abs(ref).max()), rtol=1e-4)


def test_fp8_experts_decode_rows_equal_prefill_rows():
    """FP8 experts on a prefill chunk and on one-token decode steps: W8A8 quantizes per token and
    the grouped GEMM is per row, so a token's output does not depend on the rows beside it."""
    p = quantize_params(weights(), QuantRecipe())["layers"][0]["mlp"]
    x = x_BTD()
    run = jax.jit(lambda x: moe_mlp(p, x, jnp.ones(x.shape[:2], bool), CFG)[0])
    full = run(x)
    steps = [run(x[:, :3])] + [run(x[:, i : i + 1]) for i in (3, 4)]
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-6, rtol=1e-6)


def test_routing_replay_uses_the_given_experts():
    """``expert_ids_NK``: the own top-k reproduces routing exactly; other ids get the router's
    probabilities of those experts, renormalized over them (Qwen3-MoE top-k normalization)."""
    p = weights()["layers"][0]["mlp"]
    x = x_BTD().reshape(-1, CFG.hidden_size)
    top_w, top_i, probs = route(x, p["router"], CFG)
    w2, i2, _ = route(x, p["router"], CFG, expert_ids_NK=top_i)
    np.testing.assert_array_equal(i2, top_i)
    np.testing.assert_array_equal(w2, top_w)
    ids = jnp.broadcast_to(jnp.array([3, 0]), top_i.shape)
    w3, i3, _ = route(x, p["router"], CFG, expert_ids_NK=ids)
    pk = np.asarray(probs)[:, [3, 0]]
    np.testing.assert_array_equal(i3, ids)
    np.testing.assert_allclose(w3, pk / pk.sum(-1, keepdims=True), rtol=1e-6)
    y, _ = moe_mlp(p, x.reshape(2, 5, -1), jnp.ones((2, 5), bool), CFG, expert_ids_NK=top_i)
    y_own, _ = moe_mlp(p, x.reshape(2, 5, -1), jnp.ones((2, 5), bool), CFG)
    np.testing.assert_array_equal(y, y_own)
