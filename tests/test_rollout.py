"""The one rollout helper (generation.rollout): cast -> quantize -> pin -> engine.

Tiny Qwen3-style model (D=32, 2 layers, vocab 64), 4 prompts, up to 4 new tokens. The helper must
be exactly the composition it names, so its outputs are compared bit for bit with the pieces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation import (
    RolloutConfig,
    SamplingConfig,
    cast_floats,
    generate,
    rollout,
)
from fp8rl_jax.quant import QArray, quantize_params
from fp8rl_jax.rl import calibrate_program
from tests.testing import TINY_MODEL, tiny_params, tiny_prompts

MODEL = TINY_MODEL
FP8_KV = RolloutConfig(max_new_tokens=4, kv_cache_dtype="float8_e4m3fn")  # W8A8 + static FP8 KV


def _prompts():
    return tiny_prompts((5, 7, 3, 8))


def test_rollout_is_cast_quantize_pin_generate():
    params, prompts = tiny_params(), _prompts()
    kv = calibrate_program(MODEL, FP8_KV)(params, prompts)
    greedy = SamplingConfig(temperature=0.0)
    pinned = []

    def pin(weights):
        pinned.append(weights)
        return weights

    ro, metrics = rollout(
        params, prompts, MODEL, FP8_KV, jax.random.key(3), kv, sampling=greedy, pin=pin
    )
    weights = quantize_params(cast_floats(params, FP8_KV.compute_dtype), FP8_KV.quant)
    want = generate(
        weights, prompts, MODEL, greedy, jax.random.key(3), kv_cache_dtype="float8_e4m3fn",
        kv_scales=kv, max_new_tokens=4,
    )  # fmt: skip
    np.testing.assert_array_equal(ro.tokens_BT, want.tokens_BT)
    np.testing.assert_array_equal(ro.logp_BT, want.logp_BT)
    # The pin saw the rollout copy: QArray linear layers, the rest cast to compute_dtype.
    assert len(pinned) == 1 and isinstance(pinned[0]["layers"][0]["attn"]["wq"], QArray)
    assert pinned[0]["embed"].dtype == jnp.bfloat16
    assert int(metrics["quant_nonfinite"]) == 0
    np.testing.assert_allclose(float(metrics["response_len_mean"]), np.mean(want.response_lens_B))


def test_rollout_without_quantization_or_static_scales_ignores_kv_scales():
    """A BF16 rollout with a BF16 cache never reads ``kv_scales`` (None is fine)."""
    rc = RolloutConfig(max_new_tokens=4, quant=None)
    ro, metrics = rollout(tiny_params(), _prompts(), MODEL, rc, jax.random.key(3), None)
    want = generate(
        cast_floats(tiny_params(), jnp.bfloat16), _prompts(), MODEL, rc.sampling, jax.random.key(3),
        max_new_tokens=4,
    )  # fmt: skip
    np.testing.assert_array_equal(ro.tokens_BT, want.tokens_BT)
    assert int(metrics["quant_nonfinite"]) == 0


def test_unknown_engine_is_rejected_by_the_config():
    with pytest.raises(ValueError, match="RolloutConfig.engine must be one of"):
        RolloutConfig(engine="vllm")
