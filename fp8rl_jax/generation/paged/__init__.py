"""The paged rollout engine: page pool, continuous batching, shared prompts.

See docs/PAGED_ENGINE.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from fp8rl_jax.generation.config import PagedConfig
from fp8rl_jax.generation.generate import Prompts, Rollout, engine_inputs, response_budget
from fp8rl_jax.generation.kv import KVScales, check_kernel_page_size
from fp8rl_jax.generation.paged.admit import group_leaders
from fp8rl_jax.generation.paged.engine import run_engine
from fp8rl_jax.generation.paged.plan import FIELD, PoolPlan, plan_pool
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
) -> tuple[Rollout, dict] | tuple[Rollout, dict, EngineState]:
    """``generate``'s contract (same arguments, same ``Rollout``) on the paged engine; also
    returns the engine metrics (device scalars), and the final state with ``return_state``.

    Rows with identical consecutive prompts share their prompt pages (a GRPO group). The output
    does not depend on ``paged`` (slots, page size, pool): only on each request's prompt and
    key stream. ``response_budget_B``: optional per-request budgets (<= ``max_new_tokens``).
    """
    paged = PagedConfig() if paged is None else paged
    prompts, dtype, mode, k_scale, v_scale = engine_inputs(
        "generate_paged", prompts, cfg, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens
    )
    check_kernel_page_size(paged.page_size, kernels, FIELD)
    b, p = prompts.tokens_BP.shape
    plan = plan_pool(
        paged, cfg, num_requests=b, prompt_len=p, max_new_tokens=int(max_new_tokens),
        cache_dtype=dtype, mode=mode,
    )  # fmt: skip
    spec = EngineSpec(
        plan=plan, model=cfg, sampling=sampling, stop_ids=tuple(int(t) for t in stop_token_ids),
        cache_dtype=dtype, mode=mode, kernels=kernels,
    )  # fmt: skip
    ro, metrics, state = run_engine(
        weights,
        prompts,
        rng,
        k_scale,
        v_scale,
        response_budget(response_budget_B, b, plan.max_new_tokens),
        spec=spec,
    )
    return (ro, metrics, state) if return_state else (ro, metrics)


__all__ = [
    "EngineSpec",
    "EngineState",
    "PoolPlan",
    "check_kernel_page_size",
    "generate_paged",
    "group_leaders",
    "plan_pool",
]
