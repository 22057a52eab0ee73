"""The paged engine on a mesh: one engine per batch shard, each with its own page pool.

GSPMD cannot split a page pool: the pool, the page tables and the admission scans have no batch
dimension it could follow, so under a mesh it keeps one pool for the whole batch on every
device, and every device runs every slot. When the rollout weights are whole on every device
(no ``tensor`` axis; no ``expert`` axis for an MoE model), the batch axes instead run the engine
inside ``jax.shard_map``: each shard admits and decodes its own rows (whole GRPO groups, so
prompt pages are still shared) in a pool of ``rollout.paged`` pages per device, and samples row
b with the key of its global id, so the tokens equal those of one engine over the whole batch.
Metrics are summed (counts) or maxed (peaks) over the shards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from fp8rl_jax.generation.engine import Prompts, Rollout
from fp8rl_jax.models.rows import dividing_axes  # the rollout's batch axes too

_MAX = ("engine_decode_steps", "engine_iterations", "engine_peak_page_fraction")
_MEAN = ("engine_slot_utilization",)  # the rest are counts: summed


def batch_axes(num_requests: int) -> tuple[str, ...]:
    """The installed mesh's batch axes to run one engine per shard over (() = one engine):
    the longest prefix of ``BATCH_AXES`` (size > 1) whose product divides the request count,
    unless heads are split over ``tensor``.

    Every shard's engine runs the whole model: the weights enter ``shard_map`` replicated
    (``P()``), so a MoE's expert stacks, split over ``expert`` in the rollout layout, are
    all-gathered once per rollout (the FP8 experts of Qwen3-30B-A3B: ~29 GB per device) and each
    engine routes its own tokens locally: an engine's decode loop runs its own number of
    iterations, so no collective may sit inside it (``models.moe_parallel`` steps aside under a
    manual ``expert`` axis).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    sizes = dict(mesh.shape)
    if sizes.get("tensor", 1) > 1:
        return ()  # heads split over devices: a per-shard engine would need the whole heads
    return dividing_axes(sizes, num_requests)


def _reduce(metrics: dict, axes) -> dict:
    def one(name, x):
        if name in _MAX:
            return jax.lax.pmax(x, axes)
        return jax.lax.pmean(x, axes) if name in _MEAN else jax.lax.psum(x, axes)

    return {k: one(k, v) for k, v in metrics.items()}


def run_sharded(
    local: Callable, axes, weights, prompts: Prompts, rng, kv_scales, budget_B, record=False
):
    """``local(weights, prompts, rng, kv_scales, budget_B, row0) -> (Rollout, metrics)`` on
    every shard of the batch axes ``axes``; the global ``(Rollout, metrics)``."""
    mesh = jax.sharding.get_abstract_mesh()
    b, p = prompts.tokens_BP.shape
    rows = b // math.prod(mesh.shape[a] for a in axes)

    def body(w, tokens_BP, lens_B, key, scales, budget):
        row0 = jax.lax.axis_index(axes) * rows
        ro, metrics = local(w, Prompts(tokens_BP, lens_B), key, scales, budget, row0)
        amax = jax.tree.map(lambda x: jax.lax.pmax(x, axes), ro.qkv_amax)
        return dataclasses.replace(ro, qkv_amax=amax), _reduce(metrics, axes)

    batch = P(axes)
    ids = batch if record else None  # routing replay's expert ids, when recorded
    ro_spec = Rollout(
        batch, batch, batch, batch, batch, qkv_amax=P(), prompt_len=p, expert_ids_BTLK=ids
    )
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), batch, batch, P(), P(), batch),
        out_specs=(ro_spec, P()),
        check_vma=False,
    )(weights, prompts.tokens_BP, prompts.lens_B, rng, kv_scales, budget_B)
