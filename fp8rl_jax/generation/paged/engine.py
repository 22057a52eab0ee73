"""The paged engine: continuous batching over a page pool in one jitted ``while_loop``.

docs/PAGED_ENGINE.md. Each iteration releases finished slots, admits queued requests (prefilling
new prompts into shared pages, ``admit``), gives a page to every running slot at a page boundary
(preempting the youngest request when the pool runs dry), and decodes one token for every
running slot. Request b's token a is sampled with ``fold_in(fold_in(rng, a), b)``, the static
engine's key, so the output does not depend on slots, pages or preemptions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.engine import Prompts, Rollout, make_rollout
from fp8rl_jax.generation.kv import init_paged_cache
from fp8rl_jax.generation.paged import pages
from fp8rl_jax.generation.paged.admit import Inputs, admit, drop_idle_groups, group_leaders
from fp8rl_jax.generation.paged.state import EngineSpec, EngineState, init_state
from fp8rl_jax.generation.sampling import sample_with_keys, token_keys
from fp8rl_jax.models import forward


def release(s: EngineState, spec: EngineSpec) -> EngineState:
    """Finished slots give their pages back and become free."""
    y = spec.plan.page_size
    gone_U = (s.req_U >= 0) & s.done_U
    refs = pages.drop_slots(s.refs_X, s.cache.page_table_UW, s.cache.lengths_U, gone_U, y)
    return dataclasses.replace(
        s, refs_X=refs, req_U=jnp.where(gone_U, -1, s.req_U), done_U=s.done_U & ~gone_U
    )


def _need_U(s: EngineState, y: int) -> jax.Array:
    """Running slots whose next write opens a new page."""
    return s.active_U & (s.cache.lengths_U % y == 0)


def _preempt_youngest(s: EngineState, spec: EngineSpec, leader_B) -> EngineState:
    """Recompute preemption: the running request with the largest id frees its pages and is
    queued again (it will regenerate the same tokens); its group drops its pages if idle."""
    y = spec.plan.page_size
    victim = jnp.argmax(jnp.where(s.active_U, s.req_U, -1))
    hit_U = jnp.arange(s.req_U.shape[0]) == victim
    refs = pages.drop_slots(s.refs_X, s.cache.page_table_UW, s.cache.lengths_U, hit_U, y)
    counters = dataclasses.replace(s.counters, preemptions=s.counters.preemptions + 1)
    s = dataclasses.replace(
        s, refs_X=refs, req_U=jnp.where(hit_U, -1, s.req_U), counters=counters,
        queued_B=s.queued_B.at[s.req_U[victim]].set(True),
    )  # fmt: skip
    return drop_idle_groups(s, leader_B)


def grow(s: EngineState, spec: EngineSpec, leader_B) -> EngineState:
    """A page for every running slot at a page boundary; preempts while the pool is short
    (never the last running request: the pool fits one request, so it always progresses)."""
    y = spec.plan.page_size

    def short(st: EngineState):
        need = jnp.sum(_need_U(st, y))
        return (need > pages.num_free(st.refs_X)) & (jnp.sum(st.active_U) > 1)

    s = jax.lax.while_loop(short, lambda st: _preempt_youngest(st, spec, leader_B), s)
    need_U = _need_U(s, y)
    page_U, refs = pages.take(s.refs_X, need_U)
    slot_U = jnp.where(need_U, jnp.arange(need_U.shape[0]), need_U.shape[0])
    table = s.cache.page_table_UW.at[slot_U, s.cache.lengths_U // y].set(page_U, mode="drop")
    in_use = s.refs_X.shape[0] - pages.num_free(refs)
    counters = dataclasses.replace(
        s.counters, peak_pages=jnp.maximum(s.counters.peak_pages, in_use)
    )
    cache = dataclasses.replace(s.cache, page_table_UW=table)
    return dataclasses.replace(s, cache=cache, refs_X=refs, counters=counters)


def decode(s: EngineState, spec: EngineSpec, inp: Inputs) -> EngineState:
    """One token for every running slot: forward over the pages, sample, record by request."""
    b = spec.plan.num_requests
    active_U = s.active_U
    out = forward(
        inp.weights, s.last_U[:, None], spec.model,
        segment_ids_BT=active_U[:, None].astype(jnp.int32), cache=s.cache, kernels=spec.kernels,
        return_expert_ids=s.ids_BALK is not None,
    )  # fmt: skip
    s = _record_expert_ids(s, out.expert_ids_BTLK, b)
    keys_U = token_keys(inp.rng, s.n_U, jnp.maximum(s.req_U, 0) + inp.row0)
    tok_U, logp_U = sample_with_keys(keys_U, out.logits_BTV[:, 0], spec.sampling)
    req_U = jnp.where(active_U, s.req_U, b)
    n_U = s.n_U + active_U
    stop_U = jnp.isin(tok_U, jnp.asarray(spec.stop_ids, jnp.int32)) if spec.stop_ids else False
    fin_U = active_U & (stop_U | (n_U >= inp.budget_B[jnp.maximum(s.req_U, 0)]))
    fin_req_U = jnp.where(fin_U, req_U, b)
    counters = dataclasses.replace(
        s.counters, decode_steps=s.counters.decode_steps + 1,
        busy_slot_steps=s.counters.busy_slot_steps + jnp.sum(active_U),
        peak_active=jnp.maximum(s.counters.peak_active, jnp.sum(active_U)),
    )  # fmt: skip
    return dataclasses.replace(
        s, cache=out.cache, counters=counters, n_U=n_U, done_U=s.done_U | fin_U,
        last_U=jnp.where(active_U, tok_U, s.last_U),
        out_BA=s.out_BA.at[req_U, s.n_U].set(tok_U, mode="drop"),
        logp_BA=s.logp_BA.at[req_U, s.n_U].set(logp_U, mode="drop"),
        lens_B=s.lens_B.at[fin_req_U].set(n_U, mode="drop"),
        finished_B=s.finished_B.at[fin_req_U].set(True, mode="drop"),
    )  # fmt: skip


def _record_expert_ids(s: EngineState, ids_U1LK, b: int) -> EngineState:
    """Stores the experts of the token each running slot just fed: its response token
    ``n_U - 1`` (a slot's first step feeds the last prompt token, recorded by the prefill)."""
    if s.ids_BALK is None:
        return s
    row_U = jnp.where(s.active_U & (s.n_U > 0), s.req_U, b)
    ids = s.ids_BALK.at[row_U, jnp.maximum(s.n_U - 1, 0)].set(ids_U1LK[:, 0], mode="drop")
    return dataclasses.replace(s, ids_BALK=ids)


def bookkeeping_due(s: EngineState, spec: EngineSpec) -> jax.Array:
    """Whether release, admission and page growth can change anything this iteration: a
    finished slot to release, a queued request and a free slot, or a running slot whose next
    write opens a page. Otherwise all three are the identity (every scatter index is dropped),
    and so is ``drop_idle_groups``: nothing it reads (queue, running slots, resident groups)
    changed since it last ran, and it is idempotent."""
    gone = jnp.any((s.req_U >= 0) & s.done_U)
    admissible = jnp.any(s.queued_B) & jnp.any(s.req_U < 0)
    return gone | admissible | jnp.any(_need_U(s, spec.plan.page_size))


def step(s: EngineState, spec: EngineSpec, inp: Inputs) -> EngineState:
    """One iteration of the loop: release, admit, grow, decode. The first three run under one
    ``lax.cond`` (``bookkeeping_due``): most iterations of a long response only decode, and
    their page and slot updates would be launches of their own on an accelerator."""
    s = jax.lax.cond(
        bookkeeping_due(s, spec),
        lambda: grow(admit(release(s, spec), spec, inp), spec, inp.leader_B),
        lambda: s,
    )
    s = jax.lax.cond(jnp.any(s.active_U), lambda: decode(s, spec, inp), lambda: s)
    its = s.counters.iterations + 1
    return dataclasses.replace(s, counters=dataclasses.replace(s.counters, iterations=its))


def finish(s: EngineState, spec: EngineSpec, inp: Inputs) -> EngineState:
    """After the loop: the last finished slots give their pages back."""
    return drop_idle_groups(release(s, spec), inp.leader_B)


def start(
    weights, prompts: Prompts, rng, kv_scales, budget_B, q_scale_LK, spec: EngineSpec, row0=0
):
    """(initial EngineState, Inputs): an empty pool, every request queued."""
    plan = spec.plan
    static = kv_scales is not None
    cache = init_paged_cache(
        spec.model, plan.num_pages, plan.page_size, plan.num_slots, plan.table_width,
        dtype=spec.cache_dtype, mode=spec.mode, k_scale=kv_scales.k if static else None,
        v_scale=kv_scales.v if static else None, q_scale=q_scale_LK,
    )  # fmt: skip
    inp = Inputs(
        weights, prompts, group_leaders(prompts), kv_scales, q_scale_LK, rng, budget_B, row0
    )
    return init_state(spec, cache), inp


def _rollout(s: EngineState, inp: Inputs) -> Rollout:
    ids = None
    if s.ids_BALK is not None:  # a group's prompt experts were recorded at its leader
        ids = jnp.concatenate([s.ids_BPLK[inp.leader_B], s.ids_BALK], 1)
    return make_rollout(inp.prompts, s.out_BA, s.logp_BA, s.lens_B, s.amax, ids)


def metrics(s: EngineState, spec: EngineSpec) -> dict:
    """The engine's per-rollout metrics (device scalars)."""
    c, plan = s.counters, spec.plan
    steps = jnp.maximum(c.decode_steps, 1) * plan.num_slots
    return {
        "engine_slot_utilization": c.busy_slot_steps / steps,
        "engine_peak_pages": c.peak_pages,
        "engine_peak_page_fraction": c.peak_pages / plan.num_pages,
        "engine_peak_active_slots": c.peak_active,
        "engine_pages_in_use_end": plan.num_pages - pages.num_free(s.refs_X),
        "engine_admissions": c.admissions,
        "engine_preemptions": c.preemptions,
        "engine_prefills": c.prefills,
        "engine_decode_steps": c.decode_steps,
        "engine_iterations": c.iterations,
        "engine_unfinished": jnp.sum(~s.finished_B),
    }


@functools.partial(jax.jit, static_argnames=("spec",))
def run_engine(
    weights,
    prompts: Prompts,
    rng,
    kv_scales,
    budget_B,
    q_scale_LK=None,
    row0=0,
    *,
    spec: EngineSpec,
):
    """(Rollout, metrics, final EngineState) of the paged engine over every row of ``prompts``;
    ``row0``: the global id of its first row (a shard of a batch), for the sampling keys."""
    state, inp = start(weights, prompts, rng, kv_scales, budget_B, q_scale_LK, spec, row0)

    def cond(st: EngineState):
        return ~jnp.all(st.finished_B) & (st.counters.iterations < spec.plan.max_iterations)

    state = jax.lax.while_loop(cond, lambda st: step(st, spec, inp), state)
    state = finish(state, spec, inp)
    return _rollout(state, inp), metrics(state, spec), state
