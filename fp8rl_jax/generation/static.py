"""The static engine: prefill + ``lax.while_loop`` decode of one batch in one jitted function.

Prompts are left-padded to a bucketed length P (``make_prompts``), so prompts of similar lengths
share one compiled program; the program depends only on (B, P, max_new_tokens, the static
configs). Row b's prompt occupies cache slots ``P - len_b .. P - 1`` (the pad slots are written but
invalid) and its real tokens have positions ``0 .. len_b - 1``, so a prompt gives the same tokens
whatever its padding. Response slot a of row b (A = ``max_new_tokens`` slots) is written at
cache slot ``P + a``.

The batch is static: a finished row idles until every row is done (continuous batching, where a
finished sequence's room goes to the next request, is the paged engine, ``generation.paged``).

The T = 1 decode step runs over the dense ``generation.kv.KVCache``: the model's jnp
``attention``, or ``kernels_pallas.decode_attention`` when ``kernels.decode_attention`` names an
implementation, which reads each row's live range ``[P - len_b, P + n)`` only (the valid slots of
a row are contiguous: left pads, then prompt, then response; the cache owns its alignment).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fp8rl_jax.generation.config import RolloutConfig
from fp8rl_jax.generation.engine import (
    Capabilities,
    EngineFn,
    Prompts,
    Rollout,
    engine_inputs,
    make_rollout,
    prefill,
    response_budget,
)
from fp8rl_jax.generation.kv import KVCache, KVScales, cache_len, extend_cache, init_cache
from fp8rl_jax.generation.sampling import SamplingConfig, sample
from fp8rl_jax.models import ModelConfig, forward
from fp8rl_jax.models.moe import REPLAY_NONE
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-row decode-loop state (the carry of the while loop)."""

    step: jax.Array  # int32: loop iterations so far (also the RNG stream index)
    last_B: jax.Array  # int32: last sampled token, input of the next step
    pos_B: jax.Array  # int32: position of last_B
    n_B: jax.Array  # int32: response length so far
    done_B: jax.Array  # bool: stop token sampled or budget reached
    out_BA: jax.Array  # int32 response tokens, one per response slot
    logp_BA: jax.Array  # f32 their log-probs
    cache: KVCache
    ids_BALK: jax.Array | None = None  # int16 experts of each response slot's token (recording)


def _record_expert_ids(state: DecodeState, ids_BLK, max_new) -> DecodeState:
    """Stores the experts of the token a decode step just ran (response slot ``n_B - 1``)."""
    if state.ids_BALK is None:
        return state
    rows = jnp.arange(ids_BLK.shape[0])
    idx = jnp.where(state.done_B, max_new, state.n_B - 1)  # done rows: dropped
    return dataclasses.replace(
        state, ids_BALK=state.ids_BALK.at[rows, idx].set(ids_BLK, mode="drop")
    )


def _initial_state(prompts: Prompts, cache, max_new: int, prompt_ids_BPLK) -> DecodeState:
    """The decode carry after the prefill (nothing sampled yet)."""
    b = prompts.tokens_BP.shape[0]
    ids_BALK = None
    if prompt_ids_BPLK is not None:
        shape = (b, max_new, *prompt_ids_BPLK.shape[2:])
        ids_BALK = jnp.full(shape, REPLAY_NONE, jnp.int16)
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        last_B=jnp.zeros((b,), jnp.int32),
        pos_B=prompts.lens_B - 1,
        n_B=jnp.zeros((b,), jnp.int32),
        done_B=jnp.zeros((b,), bool),
        out_BA=jnp.zeros((b, max_new), jnp.int32),
        logp_BA=jnp.zeros((b, max_new), jnp.float32),
        cache=cache,
        ids_BALK=ids_BALK,
    )


def _record(state: DecodeState, tok_B, logp_B, stop_ids, max_new, budget_B) -> DecodeState:
    """Writes a sampled token at each live row's response slot and updates the done flags
    (a row is done after a stop token or ``budget_B[b]`` tokens)."""
    live = ~state.done_B
    rows = jnp.arange(tok_B.shape[0])
    idx = jnp.where(live, state.n_B, max_new)  # out-of-bounds index: dropped for done rows
    out = state.out_BA.at[rows, idx].set(tok_B, mode="drop")
    logp = state.logp_BA.at[rows, idx].set(logp_B, mode="drop")
    n_B = state.n_B + live
    is_stop = jnp.isin(tok_B, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else False
    done = state.done_B | (live & is_stop) | (n_B >= budget_B)
    return dataclasses.replace(
        state, last_B=jnp.where(live, tok_B, state.last_B), out_BA=out, logp_BA=logp, n_B=n_B,
        done_B=done,
    )  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "cfg", "sampling", "cache_dtype", "mode", "max_new_tokens", "stop_ids", "kernels",
        "record_expert_ids",
    ),
)  # fmt: skip
def _generate(weights, prompts, rng, kv_scales, budget_B=None, q_scale_LK=None, *, cfg, sampling,
              cache_dtype, mode, max_new_tokens, stop_ids, kernels, record_expert_ids):  # fmt: skip
    b, p = prompts.tokens_BP.shape
    budget_B = response_budget(budget_B, b, max_new_tokens)
    # The prefill fills a prompt-sized cache (its attention spans P slots, not P + N); the
    # decode loop then gets the response slots.
    static = kv_scales is not None
    cache = init_cache(
        cfg, b, p, dtype=cache_dtype, mode=mode, k_scale=kv_scales.k if static else None,
        v_scale=kv_scales.v if static else None, q_scale=q_scale_LK,
    )  # fmt: skip
    logits_BV, cache, amax, prompt_ids = prefill(
        weights, prompts, cfg, cache, kernels, record_expert_ids
    )
    cache = extend_cache(cache, cache_len(p + max_new_tokens, kernels))
    state = _initial_state(prompts, cache, max_new_tokens, prompt_ids)
    tok, logp = sample(jax.random.fold_in(rng, 0), logits_BV, sampling)
    state = _record(state, tok, logp, stop_ids, max_new_tokens, budget_B)

    def cond(s: DecodeState):
        return (s.step < max_new_tokens - 1) & ~jnp.all(s.done_B)

    def body(s: DecodeState):
        pos_B = s.pos_B + 1
        out = forward(
            weights,
            s.last_B[:, None],
            cfg,
            positions_BT=pos_B[:, None],
            segment_ids_BT=(~s.done_B)[:, None].astype(jnp.int32),
            cache=s.cache,
            kernels=kernels,
            return_expert_ids=s.ids_BALK is not None,
        )
        if out.expert_ids_BTLK is not None:
            s = _record_expert_ids(s, out.expert_ids_BTLK[:, 0], max_new_tokens)
        step = s.step + 1
        tok, logp = sample(jax.random.fold_in(rng, step), out.logits_BTV[:, 0], sampling)
        s = dataclasses.replace(s, step=step, pos_B=pos_B, cache=out.cache)
        return _record(s, tok, logp, stop_ids, max_new_tokens, budget_B)

    state = jax.lax.while_loop(cond, body, state)
    ids = None if prompt_ids is None else jnp.concatenate([prompt_ids, state.ids_BALK], 1)
    return make_rollout(prompts, state.out_BA, state.logp_BA, state.n_B, amax, ids)


def generate(
    weights: dict,
    prompts: Prompts | tuple[jax.Array, jax.Array],
    cfg: ModelConfig,
    sampling: SamplingConfig,
    rng: jax.Array,
    *,
    kv_cache_dtype: str = "bfloat16",
    kv_scale_mode: str = "static",
    kv_scales: KVScales | None = None,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    kernels: KernelImpls = DEFAULT_KERNELS,
    record_expert_ids: bool = False,
    response_budget_B: jax.Array | None = None,
    fp8_attention: bool = False,
) -> Rollout:
    """Samples up to ``max_new_tokens`` per prompt; one compiled program per padded shape.

    ``prompts``: a ``Prompts`` or ``(prompt_tokens_BP, prompt_lens_B)``, left-padded.
    ``weights`` may hold QArray leaves (``quantize_params``): the linear layers then run W8A8.
    ``kv_cache_dtype``: "bfloat16"/"float32" (no scales) or "float8_e4m3fn"/"float8_e5m2" with
    ``kv_scale_mode`` "static" (``kv_scales`` required: ``KVScales``, k and v [L, K])
    or "dynamic" (a scale per cached vector). Generation of a row stops after a token in
    ``stop_token_ids`` (kept in the response) or at the budget; the loop exits when all rows stop.
    ``kernels``: the implementation of each kernel op (the W8A8 matmul; decode attention, where
    None runs the model's jnp attention and "auto" | "xla" | "pallas_*" route the one-token steps
    through ``kernels_pallas.decode_attention``). ``record_expert_ids``: return the experts each
    token went to in each MoE layer (``Rollout.expert_ids_BTLK``, for routing replay; None for a
    dense model). ``response_budget_B``: optional per-row budgets (<= ``max_new_tokens``;
    benchmarks force long-tailed lengths with it). ``fp8_attention``: Q is cast to E4M3 with
    the static scales ``kv_scales.q`` before it meets the cache (emulated FP8 attention).
    """
    inp = engine_inputs(
        "generate", prompts, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens,
        fp8_attention,
    )  # fmt: skip
    stop_ids = tuple(int(t) for t in stop_token_ids)
    return _generate(
        weights, inp.prompts, rng, inp.kv_scales, response_budget_B, inp.q_scale_LK, cfg=cfg,
        sampling=sampling,
        cache_dtype=inp.cache_dtype, mode=inp.mode, max_new_tokens=int(max_new_tokens),
        stop_ids=stop_ids, kernels=kernels, record_expert_ids=bool(record_expert_ids),
    )  # fmt: skip


def _run(
    weights, prompts, model_cfg, rollout_cfg: RolloutConfig, sampling, rng, kv_scales, *,
    record_expert_ids: bool = False, group_size: int = 1,
) -> tuple[Rollout, dict]:  # fmt: skip
    """The static engine under the ``engine.Engine`` contract (no metrics of its own; one dense
    batch, so ``group_size`` changes nothing)."""
    del group_size
    ro = generate(
        weights, prompts, model_cfg, sampling, rng, kv_cache_dtype=rollout_cfg.kv_cache_dtype,
        kv_scale_mode=rollout_cfg.kv_scale_mode,
        kv_scales=kv_scales if rollout_cfg.static_kv_scales else None,
        max_new_tokens=rollout_cfg.max_new_tokens, stop_token_ids=rollout_cfg.stop_token_ids,
        kernels=rollout_cfg.kernels, record_expert_ids=record_expert_ids,
        fp8_attention=rollout_cfg.fp8_attention,
    )  # fmt: skip
    return ro, {}


STATIC_ENGINE = EngineFn(
    _run,
    Capabilities(
        router_replay=True, dynamic_kv_scales=True, response_budgets=True,
        continuous_batching=False,
    ),
)  # fmt: skip
