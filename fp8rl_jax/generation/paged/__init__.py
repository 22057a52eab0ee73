"""The paged rollout engine: page pool, continuous batching, shared prompts.

See docs/PAGED_ENGINE.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from fp8rl_jax.generation.config import PagedConfig, RolloutConfig
from fp8rl_jax.generation.engine import (
    Capabilities,
    EngineFn,
    Prompts,
    Rollout,
    engine_inputs,
    response_budget,
)
from fp8rl_jax.generation.kv import KVScales, check_kernel_page_size
from fp8rl_jax.generation.paged.admit import group_leaders
from fp8rl_jax.generation.paged.engine import run_engine
from fp8rl_jax.generation.paged.plan import FIELD, PoolPlan, plan_pool
from fp8rl_jax.generation.paged.sharded import batch_axes, run_sharded
from fp8rl_jax.generation.paged.state import EngineSpec, EngineState
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.models import ModelConfig
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls


def generate_paged(
    weights: dict,
    prompts: Prompts | tuple[jax.Array, jax.Array],
    cfg: ModelConfig,
    sampling: SamplingConfig,
    rng: jax.Array,
    *,
    paged: PagedConfig | None = None,
    kv_cache_dtype: str = "bfloat16",
    kv_scale_mode: str = "static",
    kv_scales: KVScales | None = None,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    kernels: KernelImpls = DEFAULT_KERNELS,
    return_state: bool = False,
    response_budget_B: jax.Array | None = None,
    record_expert_ids: bool = False,
    fp8_attention: bool = False,
    group_size: int = 1,
) -> tuple[Rollout, dict] | tuple[Rollout, dict, EngineState]:
    """``generate``'s contract (same arguments, same ``Rollout``) on the paged engine; also
    returns the engine metrics (device scalars), and the final state with ``return_state``.

    Rows with identical consecutive prompts share their prompt pages (a GRPO group). The output
    does not depend on ``paged`` (slots, page size, pool): only on each request's prompt and
    key stream. ``response_budget_B``: optional per-request budgets (<= ``max_new_tokens``).
    ``record_expert_ids``: MoE routing replay, as ``generate`` (a group's prompt experts are its
    first row's prefill's; a slot records each response token it feeds back). ``fp8_attention``:
    as ``generate``. Under a mesh whose devices hold the whole weights, each batch shard runs its
    own engine over a pool of ``paged`` pages per device (``paged.sharded``), with the same output.
    ``group_size``: rows come in runs of this many identical prompts (a hint that caps each
    engine's prefill batch, ``plan.plan_pool``; the output does not depend on it).
    """
    paged = PagedConfig() if paged is None else paged
    inp = engine_inputs(
        "generate_paged", prompts, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens,
        fp8_attention,
    )  # fmt: skip
    prompts, dtype, mode = inp.prompts, inp.cache_dtype, inp.mode
    check_kernel_page_size(paged.page_size, kernels, FIELD)
    b = prompts.tokens_BP.shape[0]
    budget_B = response_budget(response_budget_B, b, int(max_new_tokens))

    def local(w, prompts, key, scales, budget, row0):
        n, p = prompts.tokens_BP.shape
        plan = plan_pool(
            paged, cfg, num_requests=n, prompt_len=p, max_new_tokens=int(max_new_tokens),
            cache_dtype=dtype, mode=mode, group_size=group_size,
        )  # fmt: skip
        spec = EngineSpec(
            plan=plan, model=cfg, sampling=sampling,
            stop_ids=tuple(int(t) for t in stop_token_ids), cache_dtype=dtype, mode=mode,
            kernels=kernels, record=bool(record_expert_ids),
        )  # fmt: skip
        kv_scales, q_scale_LK = scales
        return run_engine(w, prompts, key, kv_scales, budget, q_scale_LK, row0, spec=spec)

    # On a mesh: one engine and pool per batch shard (``sharded``), when the weights allow it.
    scales = (inp.kv_scales, inp.q_scale_LK)
    axes = () if return_state else batch_axes(b)
    if axes:
        return run_sharded(
            lambda *a: local(*a)[:2], axes, weights, prompts, rng, scales, budget_B,
            record=bool(record_expert_ids),
        )  # fmt: skip
    ro, metrics, state = local(weights, prompts, rng, scales, budget_B, 0)
    return (ro, metrics, state) if return_state else (ro, metrics)


def _run(
    weights, prompts, model_cfg, rollout_cfg: RolloutConfig, sampling, rng, kv_scales, *,
    record_expert_ids: bool = False, group_size: int = 1,
) -> tuple[Rollout, dict]:  # fmt: skip
    """The paged engine under the ``engine.Engine`` contract (metrics: the ``engine_*`` keys)."""
    return generate_paged(
        weights, prompts, model_cfg, sampling, rng, paged=rollout_cfg.paged,
        kv_cache_dtype=rollout_cfg.kv_cache_dtype, kv_scale_mode=rollout_cfg.kv_scale_mode,
        kv_scales=kv_scales if rollout_cfg.static_kv_scales else None,
        max_new_tokens=rollout_cfg.max_new_tokens, stop_token_ids=rollout_cfg.stop_token_ids,
        kernels=rollout_cfg.kernels, record_expert_ids=record_expert_ids,
        fp8_attention=rollout_cfg.fp8_attention, group_size=group_size,
    )  # fmt: skip


PAGED_ENGINE = EngineFn(
    _run,
    Capabilities(
        router_replay=True, dynamic_kv_scales=True, response_budgets=True,
        continuous_batching=True,
    ),
)  # fmt: skip


__all__ = [
    "PAGED_ENGINE",
    "EngineSpec",
    "EngineState",
    "PoolPlan",
    "check_kernel_page_size",
    "generate_paged",
    "group_leaders",
    "plan_pool",
]
