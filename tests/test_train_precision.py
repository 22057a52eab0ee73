"""``rl.train_precision="fp8_rollout"``: the scoring pass and the loss forward in the rollout's FP8.

The reference is the rollout's own program: ``quantize_params`` weights and a forward that
prefills the whole sequence into an FP8 KV cache (the cached attention dequantizes K/V exactly
as the rollout's does). Gradients are checked against the straight-through identity written
out explicitly (``sg(y_fp8) + (y − sg(y))`` per linear layer, ``sg(k̂) + (k − sg(k))`` per K/V).
Tiny models (D=32, 2 layers), 8 sequences of up to 16 tokens.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.generation import (
    RolloutConfig,
    SamplingConfig,
    cast_floats,
    prompt_segment_ids,
    token_logprobs,
)
from fp8rl_jax.generation.kv import init_cache
from fp8rl_jax.models import forward
from fp8rl_jax.quant import quantize_params
from fp8rl_jax.rl import RLConfig, calibrate_program, init_train_state, jit_steps
from fp8rl_jax.rl.precision import policy_weights
from fp8rl_jax.rl.scoring import sequence_logprobs
from fp8rl_jax.rl.state import StepConfig
from fp8rl_jax.train.config import ConfigError, from_config_dict
from fp8rl_jax.train.experiment import ModelSpec
from kernels_pallas.fp8_matmul import fp8_matmul
from kernels_pallas.fp8_train_matmul import quantize_train_weight
from tests.testing import TINY_MODEL, VOCAB, assert_finite, copy_tree, tiny_params, tiny_prompts

MOE = ModelSpec(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
    architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32,
).tiny_config(VOCAB)  # fmt: skip
SAMPLING = SamplingConfig(temperature=0.9)
FP8 = RLConfig(group_size=2, train_precision="fp8_rollout")


def _rollout_cfg(kv_mode):
    if kv_mode is None:
        return RolloutConfig(sampling=SAMPLING, max_new_tokens=4)
    return RolloutConfig(
        sampling=SAMPLING, max_new_tokens=4, kv_cache_dtype="float8_e4m3fn", kv_scale_mode=kv_mode
    )


def _sequences():
    prompts = tiny_prompts((5, 9, 3, 12, 7, 16, 2, 11), seed=4)
    seg = prompt_segment_ids(prompts)
    pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
    return prompts, prompts.tokens_BP, pos, seg


def _reference_logp(params, model_cfg, ro_cfg, kv_scales):
    """The rollout's numerics: quantize_params weights, the whole sequence prefilled into the
    rollout's FP8 (or BF16) cache, the same logits processing."""
    _, tokens, pos, seg = _sequences()
    weights = quantize_params(cast_floats(params, ro_cfg.compute_dtype), ro_cfg.quant)
    B, T = tokens.shape
    if ro_cfg.fp8_kv:
        static = ro_cfg.kv_scale_mode == "static"
        cache = init_cache(
            model_cfg, B, T, dtype=ro_cfg.kv_cache_dtype, mode=ro_cfg.kv_scale_mode,
            k_scale=kv_scales.k if static else None, v_scale=kv_scales.v if static else None,
        )  # fmt: skip
    else:  # an F32 cache: the f32 attention math of the decode steps that made the response
        cache = init_cache(model_cfg, B, T, dtype=jnp.float32)
    out = forward(weights, tokens, model_cfg, positions_BT=pos, segment_ids_BT=seg, cache=cache)
    logp = token_logprobs(out.logits_BTV[:, :-1], tokens[:, 1:], ro_cfg.sampling)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def _scored(params, model_cfg, ro_cfg, rl_cfg, kv_scales):
    prompts, tokens, pos, seg = _sequences()
    weights, kv_quant = policy_weights(params, StepConfig(model_cfg, ro_cfg, rl_cfg), kv_scales)
    return sequence_logprobs(
        weights, tokens, pos, seg, model_cfg, ro_cfg.sampling, kv_quant=kv_quant
    ).logp_BT


def _setup(model_cfg, kv_mode):
    params = tiny_params(model_cfg, seed=2)
    ro_cfg = _rollout_cfg(kv_mode)
    kv = calibrate_program(model_cfg, ro_cfg)(params, _sequences()[0])
    return params, ro_cfg, kv


def test_config_is_validated_with_field_names():
    with pytest.raises(ValueError, match="train_precision"):
        RLConfig(train_precision="fp8")
    with pytest.raises(ValueError, match="fp8_backward needs train_precision"):
        RLConfig(fp8_backward=True)
    with pytest.raises(ConfigError, match=r"config\.train_precision"):
        from_config_dict(RLConfig, {"train_precision": "e4m3"})
    assert from_config_dict(RLConfig, {"group_size": 2, "train_precision": "fp8_rollout"}) == FP8


@pytest.mark.parametrize(
    "model_cfg, kv_mode",
    [(TINY_MODEL, "static"), (TINY_MODEL, "dynamic"), (TINY_MODEL, None), (MOE, "static")],
    ids=["dense-static", "dense-dynamic", "dense-bf16kv", "moe-static"],
)
def test_fp8_rollout_scoring_equals_the_rollout_numerics(model_cfg, kv_mode):
    params, ro_cfg, kv = _setup(model_cfg, kv_mode)
    seg = _sequences()[3]
    valid = np.asarray(seg)[:, 1:] > 0  # positions with a real token to predict
    ref = np.asarray(_reference_logp(params, model_cfg, ro_cfg, kv))[:, 1:]
    got = np.asarray(_scored(params, model_cfg, ro_cfg, FP8, kv))[:, 1:]
    np.testing.assert_allclose(got[valid], ref[valid], rtol=0, atol=2e-6)
    # ... and the BF16 scoring pass is measurably different from it.
    bf16 = np.asarray(_scored(params, model_cfg, ro_cfg, RLConfig(group_size=2), kv))[:, 1:]
    assert np.max(np.abs(bf16[valid] - ref[valid])) > 1e-3


def _ste_reference(monkeypatch):
    """Patches the FP8 training ops with the explicit straight-through identity."""
    sg = jax.lax.stop_gradient

    def ref_matmul(x, w, cfg):
        y8 = fp8_matmul(x, quantize_train_weight(w, cfg), out_dtype=x.dtype, impl=cfg.impl)
        y = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return sg(y8) + (y - sg(y))

    def ref_st(x, x_hat):
        return sg(x_hat) + (x.astype(jnp.float32) - sg(x.astype(jnp.float32)))

    monkeypatch.setattr(sys.modules["fp8rl_jax.quant.matmul"], "fp8_train_matmul", ref_matmul)
    monkeypatch.setattr(sys.modules["fp8rl_jax.quant.train"], "_st", ref_st)


def _objective(params, model_cfg, ro_cfg, kv):
    seg = _sequences()[3]
    return jnp.sum(_scored(params, model_cfg, ro_cfg, FP8, kv) * seg)


def test_gradients_reach_master_weights_straight_through(monkeypatch):
    params, ro_cfg, kv = _setup(TINY_MODEL, "static")
    grads = jax.grad(_objective)(params, TINY_MODEL, ro_cfg, kv)
    with monkeypatch.context() as m:
        _ste_reference(m)
        ref = jax.grad(_objective)(params, TINY_MODEL, ro_cfg, kv)
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert g.dtype == jnp.float32, name  # gradients of the FP32 master weights
        assert float(jnp.max(jnp.abs(g))) > 0, f"no gradient reaches {name}"
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-2 * scale, err_msg=name)


def test_rl_step_trains_with_fp8_rollout_precision():
    ro_cfg = dataclasses.replace(_rollout_cfg("static"), max_new_tokens=6)
    opt = optax.adam(1e-2)
    prompts = tiny_prompts((5, 7, 3, 8), 2)
    params = tiny_params()
    kv = calibrate_program(TINY_MODEL, ro_cfg)(params, prompts)
    state = init_train_state(params, opt, jax.random.key(1), kv)
    host0 = copy_tree(state)
    rollout, train = jit_steps(TINY_MODEL, ro_cfg, FP8, opt)
    rewards = jnp.asarray(np.random.default_rng(1).normal(size=8), jnp.float32)
    for _ in range(2):
        batch = rollout(state, prompts)
        state, metrics = train(state, batch, rewards)
        assert_finite(batch.metrics)
        assert_finite(metrics)
        assert int(metrics["nonfinite_skips"]) == 0
    deltas = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), host0.params, state.params)
    assert all(d > 0 for d in jax.tree.leaves(deltas)), deltas


@pytest.mark.parametrize(
    "model_cfg,leaf", [(TINY_MODEL, ("mlp", "w_up")), (MOE, ("mlp", "w_up"))], ids=["dense", "moe"]
)
def test_fp8_backward_gradients_are_close_to_the_bf16_backward(model_cfg, leaf):
    """``rl.fp8_backward``: the same straight-through gradients, from FP8 dgrad/wgrad GEMMs (MoE:
    the expert stacks' grouped FP8 backward, ``fp8_train_matmul.grouped``)."""
    params, ro_cfg, kv = _setup(model_cfg, "static")
    fp8_bwd = RLConfig(group_size=2, train_precision="fp8_rollout", fp8_backward=True)

    def objective(p, rl_cfg):
        prompts, tokens, pos, seg = _sequences()
        weights, kv_quant = policy_weights(p, StepConfig(model_cfg, ro_cfg, rl_cfg), kv)
        scores = sequence_logprobs(
            weights, tokens, pos, seg, model_cfg, ro_cfg.sampling, kv_quant=kv_quant
        )
        return jnp.sum(scores.logp_BT * seg)

    g_bf16 = jax.grad(objective)(params, FP8)
    g_fp8 = jax.grad(objective)(params, fp8_bwd)
    w_bf16 = g_bf16["layers"][0][leaf[0]][leaf[1]]
    w_fp8 = g_fp8["layers"][0][leaf[0]][leaf[1]]
    rel = float(jnp.linalg.norm(w_fp8 - w_bf16) / jnp.linalg.norm(w_bf16))
    assert 1e-3 < rel < 0.15  # FP8 rounding of the backward operands, nothing more
