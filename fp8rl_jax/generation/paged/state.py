"""The paged engine's loop carry (docs/PAGED_ENGINE.md §2) and its static specification."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.kv import PagedKVCache
from fp8rl_jax.generation.paged.plan import PoolPlan
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.models import ModelConfig, QKVAmax
from fp8rl_jax.models.moe import REPLAY_NONE
from kernels_pallas.backend import KernelImpls


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything static about one compiled engine (hashable: a jit static argument)."""

    plan: PoolPlan
    model: ModelConfig
    sampling: SamplingConfig
    stop_ids: tuple[int, ...]
    cache_dtype: jnp.dtype
    mode: str  # KV scale mode: none | static | dynamic
    kernels: KernelImpls
    record: bool = False  # MoE routing replay: record each token's experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counters:
    """Engine metrics, accumulated over the loop (int32 scalars)."""

    iterations: jax.Array
    decode_steps: jax.Array
    busy_slot_steps: jax.Array  # sum over decode steps of the active slots
    admissions: jax.Array
    preemptions: jax.Array
    prefills: jax.Array  # prompts prefilled (a group preempted or dropped while idle: again)
    peak_pages: jax.Array
    peak_active: jax.Array  # most slots decoding at once (concurrent sequences)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
    """The carry of the engine's ``while_loop``; see docs/PAGED_ENGINE.md §2."""

    cache: PagedKVCache  # page pools, page tables and lengths of the U slots
    refs_X: jax.Array  # int32 references per page; 0 = free
    req_U: jax.Array  # int32 request in the slot, -1 = free
    last_U: jax.Array  # int32 next input token of the slot
    n_U: jax.Array  # int32 response tokens so far
    done_U: jax.Array  # bool: finished, pages not yet released
    queued_B: jax.Array  # bool: waits for a slot
    finished_B: jax.Array  # bool: result complete
    out_BA: jax.Array  # int32 response tokens by request id
    logp_BA: jax.Array  # f32 their log-probs
    lens_B: jax.Array  # int32 response lengths
    gpages_BZ: jax.Array  # int32 prompt pages of group leader b (X: none)
    resident_B: jax.Array  # bool: leader b's group holds its prompt pages
    amax: QKVAmax  # running max of the prefills' Q/K/V amax
    counters: Counters
    # routing replay (spec.record): int16 experts of leader b's real prompt tokens, and of each
    # request's response tokens fed back (REPLAY_NONE where none was recorded)
    ids_BPLK: jax.Array | None = None
    ids_BALK: jax.Array | None = None

    @property
    def active_U(self) -> jax.Array:
        return (self.req_U >= 0) & ~self.done_U


def init_state(spec: EngineSpec, cache: PagedKVCache) -> EngineState:
    """Empty pool and slots, every request queued."""
    p, cfg = spec.plan, spec.model
    b, a, z = p.num_requests, p.max_new_tokens, p.prompt_pages
    i32 = jnp.zeros((), jnp.int32)
    lk = (cfg.num_layers, cfg.num_kv_heads)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    record = spec.record and n_moe > 0
    ids = (n_moe, cfg.num_experts_per_tok)
    return EngineState(
        cache=cache,
        refs_X=jnp.zeros((p.num_pages,), jnp.int32),
        req_U=jnp.full((p.num_slots,), -1, jnp.int32),
        last_U=jnp.zeros((p.num_slots,), jnp.int32),
        n_U=jnp.zeros((p.num_slots,), jnp.int32),
        done_U=jnp.zeros((p.num_slots,), bool),
        queued_B=jnp.ones((b,), bool),
        finished_B=jnp.zeros((b,), bool),
        out_BA=jnp.zeros((b, a), jnp.int32),
        logp_BA=jnp.zeros((b, a), jnp.float32),
        lens_B=jnp.zeros((b,), jnp.int32),
        gpages_BZ=jnp.full((b, z), p.num_pages, jnp.int32),
        resident_B=jnp.zeros((b,), bool),
        amax=QKVAmax(*(jnp.zeros(lk, jnp.float32) for _ in range(3))),
        counters=Counters(*(i32 for _ in range(8))),
        ids_BPLK=jnp.full((b, p.prompt_len, *ids), REPLAY_NONE, jnp.int16) if record else None,
        ids_BALK=jnp.full((b, a, *ids), REPLAY_NONE, jnp.int16) if record else None,
    )
