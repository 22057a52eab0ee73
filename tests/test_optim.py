"""The shared optimizer (train/optim.py), and AdamW's first moment in BF16 (``mu_dtype``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8rl_jax.train.optim import OptimConfig, make_optimizer


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (16, 8), jnp.float32), "b": jax.random.normal(k2, (8,))}


def _grads(step):
    k1, k2 = jax.random.split(jax.random.key(100 + step))
    return {"w": jax.random.normal(k1, (16, 8)) * 1e-3, "b": jax.random.normal(k2, (8,)) * 1e-3}


def _run(cfg, steps=5):
    opt = make_optimizer(cfg)
    params, state = _params(), None
    state = opt.init(params)
    for i in range(steps):
        upd, state = opt.update(_grads(i), state, params)
        params = optax.apply_updates(params, upd)
    return params, state


def _adam_state(state):
    (found,) = [s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if
                hasattr(s, "mu")]  # fmt: skip
    return found


def test_default_equals_optax_adamw_after_clipping():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    ours, _ = _run(cfg)
    ref = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1e-2, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.1),
    )
    params, state = _params(), None
    state = ref.init(params)
    for i in range(5):
        upd, state = ref.update(_grads(i), state, params)
        params = optax.apply_updates(params, upd)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), ours, params)


def test_bf16_mu_stores_mu_in_bf16_and_nu_in_f32():
    _, state = _run(OptimConfig(lr=1e-2, mu_dtype="bfloat16"))
    adam = _adam_state(state)
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}


def test_bf16_mu_moves_params_as_f32_mu_does_within_bf16_rounding():
    """Each step moves a param by lr · mu_hat / (sqrt(nu_hat) + eps), about lr here; BF16 mu
    carries a relative rounding error <= 2^-8 per step, so after 5 steps of lr 1e-2 the params
    differ from the f32 run's by ~5 · lr · 2^-8 (bound below: 2^-7, the Adam ratio can exceed 1)."""
    start = _params()
    p32, _ = _run(OptimConfig(lr=1e-2, weight_decay=0.0))
    p16, _ = _run(OptimConfig(lr=1e-2, weight_decay=0.0, mu_dtype="bfloat16"))
    for k in start:
        moved = np.abs(np.asarray(p32[k] - start[k]))
        assert moved.min() > 1e-4  # every param really stepped (|Δ| up to 5 · lr)
        np.testing.assert_allclose(p16[k], p32[k], rtol=0, atol=5 * 1e-2 * 2**-7)
        assert not np.array_equal(p16[k], p32[k])  # and the BF16 rounding is visible


def test_mu_dtype_is_checked_by_name():
    with pytest.raises(ValueError, match="OptimConfig.mu_dtype"):
        OptimConfig(mu_dtype="float16")
