"""The BF16 MoE experts' kernel choice (``rl.expert_matmul_impl`` -> ``KernelImpls.expert_matmul``)
reaches the scoring pass and the loss forward, and the Hopper kernels (``grouped_matmul``, in
Mosaic GPU interpret mode here) give the log-probs and gradients of ``jax.lax.ragged_dot``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation import SamplingConfig
from fp8rl_jax.models import init_weights
from fp8rl_jax.rl import RLConfig
from fp8rl_jax.rl.scoring import sequence_logprobs
from fp8rl_jax.train.experiment import ModelSpec
from kernels_pallas.backend import KernelImpls
from tests.testing import VOCAB

# Widths the kernels' 64-wide tiles divide (D = 64, expert F = 64).
MOE = ModelSpec(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=64,
    architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64,
).tiny_config(VOCAB)  # fmt: skip


def _loss(params, kernels):
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, VOCAB)
    seg = jnp.ones((2, 9), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    out = sequence_logprobs(params, tokens, pos, seg, MOE, SamplingConfig(), kernels=kernels)
    w = jnp.linspace(-1.0, 1.0, 18).reshape(2, 9)
    return jnp.sum(w * out.logp_BT), out.logp_BT


def test_hopper_expert_kernels_give_ragged_dots_logprobs_and_gradients():
    params = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16),
        init_weights(MOE, jax.random.key(1), jnp.float32, randomize_all=True),
    )
    # One program per kernel choice: eagerly, each primitive would be dispatched while the
    # interpreted kernel's callbacks still run on the CPU device, and an eager dispatch that
    # waits for the device's in-flight slot behind them hung the suite once (the XLA:CPU
    # execution semaphore, 2026-12-05); jitted, the kernels run inside one computation.
    grad = jax.jit(jax.grad(_loss, has_aux=True), static_argnums=1)
    g_xla, lp_xla = grad(params, KernelImpls(expert_matmul="xla"))
    kern = KernelImpls(expert_matmul="pallas_mosaic_gpu", interpret=True)
    g_k, lp_k = grad(params, kern)
    np.testing.assert_allclose(lp_k, lp_xla, rtol=2e-2, atol=2e-2)  # BF16 activations
    for name in ("w_gate", "w_up", "w_down"):
        a = np.asarray(g_k["layers"][0]["mlp"][name], np.float32)
        b = np.asarray(g_xla["layers"][0]["mlp"][name], np.float32)
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * np.abs(b).max())


def test_the_knob_reaches_the_forward_and_is_checked_by_name():
    assert RLConfig().kernels == KernelImpls()
    assert RLConfig(expert_matmul_impl="xla").kernels.expert_matmul == "xla"
    with pytest.raises(ValueError, match="RLConfig.expert_matmul_impl must be one of"):
        RLConfig(expert_matmul_impl="cuda")
    # An explicit Hopper kernel on this CPU (not interpret mode) is refused by the forward itself.
    params = init_weights(MOE, jax.random.key(1), jnp.bfloat16)
    with pytest.raises(ValueError, match="grouped_matmul: impl 'pallas_mosaic_gpu'.*Hopper"):
        _loss(params, RLConfig(expert_matmul_impl="pallas_mosaic_gpu").kernels)
