"""The paged rollout engine: page pool, continuous batching, shared prompts.

See docs/PAGED_ENGINE.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from fp8rl_jax.generation.config import PagedConfig
from fp8rl_jax.generation.generate import Prompts, Rollout, engine_inputs, response_budget
from fp8rl_jax.generation.kv_scales import KVScales
from fp8rl_jax.generation.paged.admit import group_leaders
from fp8rl_jax.generation.paged.engine import run_engine
from fp8rl_jax.generation.paged.plan import FIELD, PoolPlan, plan_pool
from fp8rl_jax.generation.paged.sharded import batch_axes, run_sharded
from fp8rl_jax.generation.paged.state import EngineSpec, EngineState
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.models import ModelConfig
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls
from kernels_pallas.paged_attention.pallas_mosaic_gpu import PAGE_SIZES as GPU_PAGE_SIZES
from kernels_pallas.paged_attention.pallas_tpu import PAGE_SIZES as TPU_PAGE_SIZES


def check_kernel_page_size(page_size: int, kernels: KernelImpls) -> None:
    """A paged decode kernel's tile is one page: an explicitly chosen kernel must support the
    page size (``auto`` falls back to ``xla``, which reads any page size)."""
    sizes = {"pallas_tpu": TPU_PAGE_SIZES, "pallas_mosaic_gpu": GPU_PAGE_SIZES}
    allowed = sizes.get(kernels.decode_attention)
    if allowed is not None and page_size not in allowed:
        raise ValueError(
            f"{FIELD}.page_size={page_size} is not a block size of the {kernels.decode_attention} "
            f"paged kernel {allowed} (a tile is one page)"
        )


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
    Under a mesh whose devices hold the whole weights, each batch shard runs its own engine over
    a pool of ``paged`` pages per device (``paged.sharded``), with the same output.
    """
    paged = PagedConfig() if paged is None else paged
    prompts, dtype, mode, k_scale, v_scale = engine_inputs(
        "generate_paged", prompts, cfg, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens
    )
    check_kernel_page_size(paged.page_size, kernels)
    b = prompts.tokens_BP.shape[0]
    budget_B = response_budget(response_budget_B, b, int(max_new_tokens))

    def local(w, prompts, key, scales, budget, row0):
        n, p = prompts.tokens_BP.shape
        plan = plan_pool(
            paged, cfg, num_requests=n, prompt_len=p, max_new_tokens=int(max_new_tokens),
            cache_dtype=dtype, mode=mode,
        )  # fmt: skip
        spec = EngineSpec(
            plan=plan, model=cfg, sampling=sampling,
            stop_ids=tuple(int(t) for t in stop_token_ids), cache_dtype=dtype, mode=mode,
            kernels=kernels,
        )  # fmt: skip
        return run_engine(w, prompts, key, *scales, budget, row0, spec=spec)

    # On a mesh: one engine and pool per batch shard (``sharded``), when the weights allow it.
    axes = () if return_state else batch_axes(b, cfg)
    if axes:
        return run_sharded(
            lambda *a: local(*a)[:2], axes, weights, prompts, rng, (k_scale, v_scale), budget_B
        )
    ro, metrics, state = local(weights, prompts, rng, (k_scale, v_scale), budget_B, 0)
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
