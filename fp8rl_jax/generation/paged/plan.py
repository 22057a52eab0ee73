"""Pool sizing of the paged engine: slots, pages and page tables, checked at trace time.

``plan_pool`` turns a ``PagedConfig`` and the traced shapes (B requests, padded prompt length P,
response budget A) into the static sizes of the engine's state, and raises a ``ValueError``
naming the config field when a request could never run: a prompt that does not fit the pool, a
request (P + A tokens) that can never fit it, a page size the chosen decode kernel cannot read.
The memory arithmetic is logged once per compiled shape.
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp

from fp8rl_jax.generation.config import PagedConfig
from fp8rl_jax.generation.kv import cdiv, page_bytes
from fp8rl_jax.models import ModelConfig

log = logging.getLogger(__name__)

FIELD = "rollout.paged"  # where the fields live in an experiment config


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Static sizes of one compiled paged engine (all ints)."""

    num_requests: int  # B
    prompt_len: int  # P (padded)
    max_new_tokens: int  # A
    num_slots: int  # U
    page_size: int  # Y
    num_pages: int  # X (per layer)
    table_width: int  # W = cdiv(P + A, Y): pages one sequence can hold
    prompt_pages: int  # Z = cdiv(P - 1, Y) (>= 1): pages of a group's shared prompt
    prefill_batch: int  # prompts prefilled per iteration
    page_bytes: int  # one page in every layer (K, V, dynamic scales)

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def max_iterations(self) -> int:
        """A cap on the loop (never reached when every request can finish; see the engine)."""
        return 8 * self.num_requests * (self.max_new_tokens + 1) + 64


def _num_pages(cfg: PagedConfig, worst_case: int, per_page: int) -> tuple[int, str]:
    if cfg.num_pages is not None:
        return cfg.num_pages, f"{FIELD}.num_pages"
    if cfg.kv_memory_bytes is not None:
        x = cfg.kv_memory_bytes // per_page
        if x < 1:
            raise ValueError(
                f"{FIELD}.kv_memory_bytes={cfg.kv_memory_bytes} holds no page of {per_page} bytes"
            )
        return x, f"{FIELD}.kv_memory_bytes={cfg.kv_memory_bytes} // {per_page} B per page"
    return worst_case, f"worst case of {FIELD}.num_slots (slots x pages per sequence + prompt)"


def plan_pool(
    cfg: PagedConfig,
    model: ModelConfig,
    *,
    num_requests: int,
    prompt_len: int,
    max_new_tokens: int,
    cache_dtype,
    mode: str,
    group_size: int = 1,
) -> PoolPlan:
    """The engine's static sizes; raises ``ValueError`` naming the field for impossible input.

    ``group_size``: the requests come in runs of this many identical prompts (GRPO groups), so
    they hold at most ``cdiv(B, group_size)`` distinct prompts when the runs are aligned: the
    prefill batch (a dense prompt cache of every layer plus the prefill's activations, compiled
    at ``prefill_batch`` prompts whether or not they are used) is capped there. Unaligned or
    shorter runs only take more prefill iterations; no token changes.
    """
    if group_size < 1:
        raise ValueError(f"plan_pool: group_size must be >= 1, got {group_size}")
    y = cfg.page_size
    u = num_requests if cfg.num_slots is None else cfg.num_slots
    w, z = cdiv(prompt_len + max_new_tokens, y), max(1, cdiv(prompt_len - 1, y))
    per_page = page_bytes(model, y, jnp.dtype(cache_dtype), mode)
    x, source = _num_pages(cfg, u * w + z, per_page)
    if prompt_len > x * y:
        raise ValueError(
            f"paged engine: a prompt of {prompt_len} tokens (padded) does not fit the pool of "
            f"{x} pages x {y} tokens ({source}); raise {FIELD}.num_pages / kv_memory_bytes"
        )
    if w + z > x:
        raise ValueError(
            f"paged engine: a request of {prompt_len} + {max_new_tokens} tokens needs up to "
            f"{w} + {z} pages of {y} tokens and can never fit the pool of {x} pages ({source}); "
            f"raise {FIELD}.num_pages / kv_memory_bytes or lower rollout.max_new_tokens"
        )
    plan = PoolPlan(
        num_requests=num_requests, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
        num_slots=u, page_size=y, num_pages=x, table_width=w, prompt_pages=z,
        prefill_batch=min(cfg.prefill_batch, u, cdiv(num_requests, group_size)),
        page_bytes=per_page,
    )  # fmt: skip
    log.info(
        "paged engine: %d requests over %d slots; pool %d pages (%s) x %d B = %.3f GB "
        "(%d layers x K+V x %d tokens x %d KV heads x %d head dim, %s, scales %s); "
        "%d tokens per sequence = %d pages",
        num_requests, u, x, source, per_page, plan.pool_bytes / 1e9, model.num_layers, y,
        model.num_kv_heads, model.head_dim, jnp.dtype(cache_dtype).name, mode,
        prompt_len + max_new_tokens, w,
    )  # fmt: skip
    return plan
