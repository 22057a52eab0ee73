"""The policy the scoring pass and the loss forward run: BF16, or the rollout's FP8 numerics.

``rl.train_precision="fp8_rollout"`` (``quant.train``): the weights ``quantize_params`` would
quantize multiply as their rollout FP8 copies (W8A8, 1x128 activation groups, the same matmul),
K/V are rounded through the rollout's FP8 cache (its static scales, or dynamic per-token ones),
and the log-probs take the same logits processing (K/V of a BF16 cache are upcast to f32, the
decode attention's math); gradients pass straight through every
quantizer to the FP32 master weights.
"""

from __future__ import annotations

from fp8rl_jax.generation import KVScales, cast_floats
from fp8rl_jax.quant import KVFakeQuant, kv_fake_quant, train_weights


def policy_weights(params, cfg, kv_scales: KVScales | None) -> tuple[dict, KVFakeQuant | None]:
    """(weights, ``kv_quant`` for ``models.forward``) of the scoring / loss forward.

    ``cfg``: the ``rl.StepConfig``; ``kv_scales``: the static KV scales the rollout being scored
    used (``TrainState.kv_scales`` before this step's recalibration).
    """
    weights = cast_floats(params, cfg.compute_dtype)
    if cfg.rl.train_precision == "bf16":
        return weights, None
    ro = cfg.rollout
    weights = train_weights(
        weights, ro.quant, fp8_backward=cfg.rl.fp8_backward, impl=ro.matmul_impl
    )
    return weights, kv_fake_quant(ro.kv_cache_dtype, ro.kv_scale_mode, kv_scales)
