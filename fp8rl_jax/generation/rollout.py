"""The one rollout call of the RL step and of evaluation: cast, quantize, pin, fuse, generate.

``rollout`` runs the policy exactly as the rollout engine runs it: the weights cast to
``compute_dtype``, quantized by ``rollout_cfg.quant`` (the per-step "weight sync", DESIGN.md
§4.2), optionally pinned to a rollout layout, q|k|v and gate|up fused into one GEMM each
(``models.fused``), then handed to the engine ``rollout_cfg.engine``
names. Evaluation calls it with greedy sampling, so its precision cannot drift from the
rollout's. (``rollout_cfg`` is always the ``RolloutConfig``, ``model_cfg`` the ``ModelConfig``.)

``ENGINE_IMPLS`` maps ``RolloutConfig.engine`` to an engine of the ``engine.Engine`` contract:
``static`` (``generate``) and ``paged`` (``generate_paged``: page pool, continuous batching,
shared prompts; its metrics are the ``engine_*`` keys). ``check_engine`` refuses, at config
time, a config that asks the engine for a capability it lacks.

KV-scale calibration (§4.5) lives here too: step 0 from a high-precision pass over the prompts
(``calibrate_initial_kv_scales``), every later step from the scoring pass's Q/K/V amax
(``recalibrate_kv_scales``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.config import EngineName, RolloutConfig
from fp8rl_jax.generation.engine import Engine, Prompts, Rollout, check_capabilities
from fp8rl_jax.generation.kv import KVScales, calibrate_kv_scales
from fp8rl_jax.generation.paged import PAGED_ENGINE
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.generation.static import STATIC_ENGINE
from fp8rl_jax.models import ModelConfig, QKVAmax, forward
from fp8rl_jax.models.fused import fuse_projections
from fp8rl_jax.quant import QuantStats, quantize_params

PinParams = Callable[[dict], dict]  # pins the quantized weights to a layout (inside jit)


def cast_floats(tree, dtype):
    """Casts floating leaves (weights) to ``dtype``; integer leaves pass."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def rollout_weights(
    params,
    rollout_cfg: RolloutConfig,
    pin: PinParams | None = None,
    *,
    fuse_for: ModelConfig | None = None,
) -> tuple[dict, QuantStats]:
    """The rollout copy of the weights: cast to ``compute_dtype``, quantized, pinned, fused.

    ``pin`` (e.g. ``train.sharding.rollout_params_constraint``) places the quantized weights in
    the rollout layout, so FSDP gathers run once per step, not once per generated token.
    ``fuse_for``: the engine's copy (``rollout`` passes its ``ModelConfig``): q|k|v and gate|up
    fused into one FP8 weight each where ``rollout_cfg.fuse_projections`` (``models.fused``),
    and pinned again. Without it the weights keep the checkpoint's layout (what
    ``train.export`` writes).
    """
    weights, stats = quantize_params(
        cast_floats(params, rollout_cfg.compute_dtype), rollout_cfg.quant, return_stats=True
    )
    pin = pin or (lambda w: w)
    weights = pin(weights)
    if fuse_for is not None and rollout_cfg.fuse_projections:
        # after the pin: the FP8 weights are in the rollout layout, so concatenating them needs
        # no resharding of FSDP shards (the fused dims' shards hold the parts' shards' rows)
        fused = fuse_projections(weights, fuse_for)
        weights = weights if fused is weights else pin(fused)
    return weights, stats


ENGINE_IMPLS: dict[EngineName, Engine] = {"static": STATIC_ENGINE, "paged": PAGED_ENGINE}


def check_engine(rollout_cfg: RolloutConfig, *, router_replay: bool = False) -> None:
    """Config-time check: ``rollout_cfg.engine`` has every capability the run asks for."""
    check_capabilities(
        ENGINE_IMPLS[rollout_cfg.engine].capabilities, rollout_cfg, router_replay=router_replay
    )


def rollout(
    params,
    prompts: Prompts,
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rng: jax.Array,
    kv_scales: KVScales | None = None,
    *,
    sampling: SamplingConfig | None = None,
    pin: PinParams | None = None,
    record_expert_ids: bool = False,
    group_size: int = 1,
) -> tuple[Rollout, dict]:
    """Generates with the rollout policy of ``params``; returns the rollout and its metrics.

    ``params``: high-precision weights (FP32 master or already cast). ``kv_scales``: the static
    FP8 KV scales (used only when ``rollout_cfg.static_kv_scales``). ``sampling`` overrides
    ``rollout_cfg.sampling`` (evaluation: greedy). Metrics (device scalars): ``response_len_mean``,
    ``quant_nonfinite`` (NaN/Inf weights met by the quantizer), and the engine's own.
    ``record_expert_ids``: the rollout records each token's MoE experts (routing replay).
    ``group_size``: the prompts come in runs of this many identical rows (GRPO groups); the
    paged engine then compiles a smaller prefill batch (``paged.plan_pool``), same tokens.
    """
    weights, qstats = rollout_weights(params, rollout_cfg, pin, fuse_for=model_cfg)
    sampling = rollout_cfg.sampling if sampling is None else sampling
    ro, engine_metrics = ENGINE_IMPLS[rollout_cfg.engine](
        weights, prompts, model_cfg, rollout_cfg, sampling, rng, kv_scales,
        record_expert_ids=record_expert_ids, group_size=group_size,
    )  # fmt: skip
    metrics = {
        "response_len_mean": jnp.mean(ro.response_lens_B.astype(jnp.float32)),
        "quant_nonfinite": qstats.nonfinite,
        **engine_metrics,
    }
    return ro, metrics


def prompt_segment_ids(prompts: Prompts) -> jax.Array:
    """1 on real prompt tokens, 0 on the left padding."""
    P = prompts.tokens_BP.shape[1]
    return (jnp.arange(P)[None, :] >= P - prompts.lens_B[:, None]).astype(jnp.int32)


def calibrate_initial_kv_scales(
    params, prompts: Prompts, model_cfg: ModelConfig, rollout_cfg: RolloutConfig
) -> KVScales | None:
    """Step 0 (DESIGN.md §4.5): KV scales from a high-precision pass over the prompts.

    Un-jitted: the trainer runs it as ``rl.programs``' ``calibrate`` program.
    """
    if not rollout_cfg.static_kv_scales:
        return None
    seg = prompt_segment_ids(prompts)
    pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
    params = cast_floats(params, rollout_cfg.compute_dtype)
    out = forward(
        params, prompts.tokens_BP, model_cfg, positions_BT=pos, segment_ids_BT=seg,
        return_qkv_amax=True,
    )  # fmt: skip
    return calibrate_kv_scales(
        out.qkv_amax, rollout_cfg.kv_calib_percentile, rollout_cfg.kv_calib_margin
    )


def recalibrate_kv_scales(
    qkv_amax: QKVAmax, rollout_cfg: RolloutConfig, previous: KVScales | None
) -> KVScales:
    """The next rollout's static KV scales from this step's scoring-pass amax (§4.5).

    An invalid amax entry (0, NaN, Inf) keeps ``previous``'s scale and is counted.
    """
    return calibrate_kv_scales(
        qkv_amax, rollout_cfg.kv_calib_percentile, rollout_cfg.kv_calib_margin, previous=previous
    )


def kv_scale_metrics(kv_scales: KVScales) -> dict:
    """Range of the static FP8 KV scales and how many amax entries were invalid (0/NaN/Inf)."""
    return {
        "kv_scale_k_min": jnp.min(kv_scales.k),
        "kv_scale_k_max": jnp.max(kv_scales.k),
        "kv_scale_v_min": jnp.min(kv_scales.v),
        "kv_scale_v_max": jnp.max(kv_scales.v),
        "kv_scale_invalid": kv_scales.num_invalid,
    }
