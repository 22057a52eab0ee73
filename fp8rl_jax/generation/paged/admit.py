"""Admission: queued requests into free slots, new prompts prefilled into shared pages.

docs/PAGED_ENGINE.md §3-4. Requests are admitted in id order (a prefix of the first U queued
ids), each into the next free slot, when its group's prompt is resident or among this
iteration's ``prefill_batch`` new prompts and its pages fit beside the pages the running slots
need at their next step. A group's prompt ``p_0 .. p_{n-1}`` is stored as its first n - 1
tokens; ``p_{n-1}`` is the admitted slot's first input, so the decode step samples the first
response token like every other.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.engine import Prompts, prefill
from fp8rl_jax.generation.kv import KVScales, cdiv, init_cache
from fp8rl_jax.generation.kv import paged as pkv
from fp8rl_jax.generation.paged import pages
from fp8rl_jax.generation.paged.state import EngineSpec, EngineState


class Inputs(NamedTuple):
    """The engine's traced inputs (fixed over the loop)."""

    weights: dict
    prompts: Prompts
    leader_B: jax.Array  # int32: first row of b's run of identical prompts (its group)
    kv_scales: KVScales | None  # static FP8 KV scales (None otherwise)
    q_scale_LK: jax.Array | None  # FP8 attention: Q's static scales (None: off)
    rng: jax.Array
    budget_B: jax.Array  # int32 response budget per request (<= max_new_tokens)
    row0: jax.Array | int = 0  # global id of request 0 (a shard's first row): sampling keys


def group_leaders(prompts: Prompts) -> jax.Array:
    """``leader_B``: the first row of each run of consecutive rows with the same prompt (real
    tokens and length; pad ids are ignored)."""
    tok, lens = prompts.tokens_BP, prompts.lens_B
    p = tok.shape[1]
    real = jnp.arange(p)[None, :] >= (p - lens)[:, None]
    same = jnp.all((tok[1:] == tok[:-1]) | ~real[1:], axis=1) & (lens[1:] == lens[:-1])
    start = jnp.concatenate([jnp.ones((1,), bool), ~same])
    idx = jnp.where(start, jnp.arange(tok.shape[0], dtype=jnp.int32), 0)
    return jax.lax.cummax(idx)


def _pack(x_QPKC, idx_QZY):
    """Dense prefill cache rows -> whole pages ``[Q·Z, Y, K, C]`` (token order)."""
    q, z, y = idx_QZY.shape
    got = x_QPKC[jnp.arange(q)[:, None, None], idx_QZY]
    return got.reshape(q * z, y, *x_QPKC.shape[2:])


def _pack_scales(s_QKP, idx_QZY):
    """Dense dynamic scales ``[Q, K, P]`` -> page scales ``[Q·Z, K, Y]``."""
    q, z, y = idx_QZY.shape
    got = jnp.swapaxes(s_QKP, 1, 2)[jnp.arange(q)[:, None, None], idx_QZY]  # [Q, Z, Y, K]
    return jnp.moveaxis(got, 3, 2).reshape(q * z, s_QKP.shape[1], y)


def _prefill_pages(s: EngineState, spec: EngineSpec, inp: Inputs, lead_Q, valid_Q, pages_QZ):
    """Prefills the leaders' prompts (``engine.prefill``) and stores their first n - 1 tokens in
    ``pages_QZ``; (cache, Q/K/V amax folded into the state's, the leaders' prompt experts)."""
    plan, cfg = spec.plan, spec.model
    q, p, y = plan.prefill_batch, plan.prompt_len, plan.page_size
    lens_Q = jnp.where(valid_Q, inp.prompts.lens_B[lead_Q], 0)
    prompts = Prompts(inp.prompts.tokens_BP[lead_Q], lens_Q)
    static = inp.kv_scales is not None
    dense = init_cache(
        cfg, q, p, dtype=spec.cache_dtype, mode=spec.mode,
        k_scale=inp.kv_scales.k if static else None, v_scale=inp.kv_scales.v if static else None,
        q_scale=inp.q_scale_LK,
    )  # fmt: skip
    _, dense, amax, ids_QPLK = prefill(inp.weights, prompts, cfg, dense, spec.kernels, spec.record)
    t_ZY = jnp.arange(plan.prompt_pages * y, dtype=jnp.int32).reshape(-1, y)
    idx_QZY = jnp.clip(p - lens_Q[:, None, None] + t_ZY[None], 0, p - 1)
    dynamic = spec.mode == "dynamic"
    cache = pkv.store_pages(
        s.cache,
        [_pack(x, idx_QZY) for x in dense.k],
        [_pack(x, idx_QZY) for x in dense.v],
        [_pack_scales(x, idx_QZY) for x in dense.k_scale] if dynamic else None,
        [_pack_scales(x, idx_QZY) for x in dense.v_scale] if dynamic else None,
        pages_QZ.reshape(-1),
    )
    amax = jax.tree.map(jnp.maximum, s.amax, amax)
    ids = s.ids_BPLK
    if ids is not None:
        ids = ids.at[jnp.where(valid_Q, lead_Q, ids.shape[0])].set(ids_QPLK, mode="drop")
    return cache, amax, ids


class _Candidates(NamedTuple):
    """The first U queued requests and what admitting each would take."""

    req_C: jax.Array  # request ids (B: none)
    slot_C: jax.Array  # the free slot the i-th admitted candidate takes
    lead_C: jax.Array  # group leaders
    n_C: jax.Array  # prompt tokens stored in pages (prompt length - 1)
    first_new_C: jax.Array  # first candidate of a group that must be prefilled
    admit_C: jax.Array  # admitted (a prefix)


def _candidates(s: EngineState, spec: EngineSpec, inp: Inputs) -> _Candidates:
    plan = spec.plan
    u, b, y = plan.num_slots, plan.num_requests, plan.page_size
    free_slot_U = s.req_U < 0
    slot_C = jnp.nonzero(free_slot_U, size=u, fill_value=u)[0].astype(jnp.int32)
    req_C = jnp.nonzero(s.queued_B, size=u, fill_value=b)[0].astype(jnp.int32)
    valid_C = (jnp.arange(u) < jnp.sum(free_slot_U)) & (req_C < b)
    safe_C = jnp.minimum(req_C, b - 1)
    lead_C = inp.leader_B[safe_C]
    n_C = inp.prompts.lens_B[safe_C] - 1
    new_C = valid_C & ~s.resident_B[lead_C]
    # Candidates are ascending ids and groups are runs of ids: a group's candidates are adjacent.
    first_C = new_C & jnp.concatenate([jnp.ones((1,), bool), lead_C[1:] != lead_C[:-1]])
    within_C = ~new_C | (jnp.cumsum(first_C) <= plan.prefill_batch)
    # Pages: a new group's prompt pages, and one page each (its copy of the partial prompt page,
    # or the fresh page of its first write); running slots at a page boundary keep theirs.
    need_C = jnp.where(first_C, cdiv(n_C, y), 0) + 1
    reserve = jnp.sum(s.active_U & (s.cache.lengths_U % y == 0))
    fits_C = jnp.cumsum(need_C) + reserve <= pages.num_free(s.refs_X)
    admit_C = jnp.cumprod(valid_C & within_C & fits_C).astype(bool)
    return _Candidates(req_C, slot_C, lead_C, n_C, first_C, admit_C)


def _prefill_new_groups(s: EngineState, spec: EngineSpec, inp: Inputs, c: _Candidates):
    """Allocates and fills the pages of the admitted candidates' new groups."""
    plan = spec.plan
    q, z, y, b = plan.prefill_batch, plan.prompt_pages, plan.page_size, plan.num_requests
    u = plan.num_slots
    idx_Q = jnp.nonzero(c.admit_C & c.first_new_C, size=q, fill_value=u)[0]
    valid_Q = idx_Q < u
    lead_Q = jnp.where(valid_Q, c.lead_C[jnp.minimum(idx_Q, u - 1)], 0)
    z_Q = jnp.where(valid_Q, cdiv(inp.prompts.lens_B[lead_Q] - 1, y), 0)
    need_QZ = jnp.arange(z)[None, :] < z_Q[:, None]
    pages_N, refs = pages.take(s.refs_X, need_QZ.reshape(-1))
    pages_QZ = pages_N.reshape(q, z)
    cache, amax, ids = jax.lax.cond(
        jnp.any(valid_Q),
        lambda: _prefill_pages(s, spec, inp, lead_Q, valid_Q, pages_QZ),
        lambda: (s.cache, s.amax, s.ids_BPLK),
    )
    dst_Q = jnp.where(valid_Q, lead_Q, b)
    counters = dataclasses.replace(s.counters, prefills=s.counters.prefills + jnp.sum(valid_Q))
    return dataclasses.replace(
        s, cache=cache, amax=amax, ids_BPLK=ids, refs_X=refs, counters=counters,
        gpages_BZ=s.gpages_BZ.at[dst_Q].set(pages_QZ, mode="drop"),
        resident_B=s.resident_B.at[dst_Q].set(True, mode="drop"),
    )  # fmt: skip


def _fill_slots(s: EngineState, spec: EngineSpec, inp: Inputs, c: _Candidates) -> EngineState:
    """Maps the admitted candidates' shared prompt pages, copies their partial prompt page
    (copy-on-write) and sets their slots up to feed the last prompt token."""
    plan = spec.plan
    u, b, w, y, z = (plan.num_slots, plan.num_requests, plan.table_width, plan.page_size,
                     plan.prompt_pages)  # fmt: skip
    slot_C = jnp.where(c.admit_C, c.slot_C, u)
    gp_CZ = s.gpages_BZ[c.lead_C]
    full_C = c.n_C // y
    partial_C = c.admit_C & (c.n_C % y != 0)
    copy_C, refs = pages.take(s.refs_X, partial_C)
    src_C = jnp.take_along_axis(gp_CZ, jnp.minimum(full_C, z - 1)[:, None], axis=1)[:, 0]
    cache = pkv.copy_pages(s.cache, src_C, copy_C)
    shared_CZ = (jnp.arange(z)[None, :] < full_C[:, None]) & c.admit_C[:, None]
    refs = pages.add(refs, gp_CZ.reshape(-1), shared_CZ.reshape(-1), 1)
    w_W = jnp.arange(w)[None, :]
    gp_CW = jnp.pad(gp_CZ, ((0, 0), (0, w - z)))
    row_CW = jnp.where(w_W < full_C[:, None], gp_CW, 0)
    row_CW = jnp.where((w_W == full_C[:, None]) & partial_C[:, None], copy_C[:, None], row_CW)
    cache = dataclasses.replace(
        cache,
        page_table_UW=cache.page_table_UW.at[slot_C].set(row_CW, mode="drop"),
        lengths_U=cache.lengths_U.at[slot_C].set(c.n_C, mode="drop"),
    )
    p = inp.prompts.tokens_BP.shape[1]
    last_C = inp.prompts.tokens_BP[jnp.minimum(c.req_C, b - 1), p - 1]
    counters = dataclasses.replace(
        s.counters, admissions=s.counters.admissions + jnp.sum(c.admit_C)
    )
    return dataclasses.replace(
        s, cache=cache, refs_X=refs, counters=counters,
        req_U=s.req_U.at[slot_C].set(c.req_C, mode="drop"),
        last_U=s.last_U.at[slot_C].set(last_C, mode="drop"),
        n_U=s.n_U.at[slot_C].set(0, mode="drop"),
        done_U=s.done_U.at[slot_C].set(False, mode="drop"),
        queued_B=s.queued_B.at[jnp.where(c.admit_C, c.req_C, b)].set(False, mode="drop"),
    )  # fmt: skip


def drop_idle_groups(s: EngineState, leader_B: jax.Array) -> EngineState:
    """A resident group with no queued member (all admitted) or no running member (idle)
    drops its references to its prompt pages; running members keep theirs."""
    b, x = leader_B.shape[0], s.refs_X.shape[0]
    queued_L = jnp.zeros((b,), jnp.int32).at[leader_B].add(s.queued_B.astype(jnp.int32))
    lead_U = jnp.where(s.active_U, leader_B[jnp.maximum(s.req_U, 0)], b)
    active_L = jnp.zeros((b,), jnp.int32).at[lead_U].add(1, mode="drop")
    drop_L = s.resident_B & ((queued_L == 0) | (active_L == 0))
    held_LZ = drop_L[:, None] & (s.gpages_BZ < x)
    refs = pages.add(s.refs_X, s.gpages_BZ.reshape(-1), held_LZ.reshape(-1), -1)
    return dataclasses.replace(
        s, refs_X=refs, resident_B=s.resident_B & ~drop_L,
        gpages_BZ=jnp.where(drop_L[:, None], x, s.gpages_BZ),
    )  # fmt: skip


def admit(s: EngineState, spec: EngineSpec, inp: Inputs) -> EngineState:
    """Admits a prefix of the queue into free slots (prefilling new prompts), then drops the
    prompt pages of groups with nothing left to admit or nothing running.

    The admission's updates (page tables, the copy-on-write of partial prompt pages in every
    layer, the slots' state) run under a ``lax.cond``: with no candidate admitted they are the
    identity (every index is out of range and dropped), and most iterations of a long rollout
    admit nothing, so a decode step does not launch them (``perf_model.hlo_launches``: per layer,
    the partial page's gather and scatter into the K and V pools)."""
    c = _candidates(s, spec, inp)
    s = jax.lax.cond(
        jnp.any(c.admit_C),
        lambda: _fill_slots(_prefill_new_groups(s, spec, inp, c), spec, inp, c),
        lambda: s,
    )
    return drop_idle_groups(s, inp.leader_B)
