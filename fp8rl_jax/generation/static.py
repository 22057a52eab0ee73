"""The rollout program: prefill + ``lax.while_loop`` decode in one jitted function.

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
import numpy as np

from fp8rl_jax.fields import batched
from fp8rl_jax.generation.kv import KVCache, KVScales, cache_len, extend_cache, init_cache
from fp8rl_jax.generation.sampling import SamplingConfig, sample
from fp8rl_jax.models import ModelConfig, QKVAmax, forward
from fp8rl_jax.models.moe import REPLAY_NONE
from kernels_pallas.backend import DEFAULT_KERNELS, KernelImpls

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompts:
    """Left-padded prompt token ids and their lengths."""

    tokens_BP: jax.Array = batched()  # int32, pads (any id) on the left
    lens_B: jax.Array = batched()  # int32, number of real tokens per row


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """Generated sequences (prompt + response) and the rollout log-probs of the sampled tokens."""

    tokens_BT: jax.Array = batched()  # int32 [B, P + A]: left-padded prompt, response, 0 pads
    response_mask_BT: jax.Array = batched()  # bool: response tokens (with a final stop token)
    logp_BT: jax.Array = batched()  # f32 log q(token), processed distribution; 0 off the response
    response_lens_B: jax.Array = batched()  # int32
    prompt_lens_B: jax.Array = batched()  # int32
    qkv_amax: QKVAmax  # per-layer Q/K/V amax over the prompts (prefill), for step-0 calibration
    prompt_len: int = dataclasses.field(metadata=dict(static=True))  # P (padded)
    # MoE routing replay (record_expert_ids): int16 [B, T, L_moe, k], the experts each token of
    # tokens_BT went to in each MoE layer when the rollout ran it: the real prompt tokens
    # (prefill) and every response token but the last (never fed back); REPLAY_NONE elsewhere.
    expert_ids_BTLK: jax.Array | None = batched(default=None)


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


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n (a multiple of the largest bucket beyond it)."""
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return -(-n // top) * top


def make_prompts(
    token_lists: Sequence[Sequence[int]], *, pad_id: int = 0, buckets=DEFAULT_BUCKETS
) -> Prompts:
    """Left-pads token lists to ``bucket_length(max len)`` (host-side helper)."""
    lens = [len(t) for t in token_lists]
    if min(lens) < 1:
        raise ValueError("make_prompts: every prompt needs at least one token")
    p = bucket_length(max(lens), buckets)
    arr = np.full((len(token_lists), p), pad_id, np.int32)
    for i, t in enumerate(token_lists):
        arr[i, p - len(t) :] = t
    return Prompts(jnp.asarray(arr), jnp.asarray(lens, jnp.int32))


def _static_scales(kv_scales, cfg, mode):
    if mode != "static":
        return None, None
    if kv_scales is None:
        raise ValueError(
            "generate: a static FP8 KV cache needs kv_scales (calibrate_kv_scales); scales never "
            "default to 1.0"
        )
    return kv_scales.k, kv_scales.v


def response_budget(budget_B, b: int, max_new_tokens: int) -> jax.Array:
    """Per-row response budgets ``min(budget_B, max_new_tokens)`` (None: ``max_new_tokens``)."""
    if budget_B is None:
        return jnp.full((b,), max_new_tokens, jnp.int32)
    return jnp.minimum(jnp.asarray(budget_B, jnp.int32), max_new_tokens)


def _prefill(weights, prompts: Prompts, cfg, cache, kernels: KernelImpls, record: bool):
    b, p = prompts.tokens_BP.shape
    pad_B = p - prompts.lens_B
    t = jnp.arange(p, dtype=jnp.int32)[None]
    real_BP = t >= pad_B[:, None]
    pos_BP = jnp.maximum(t - pad_B[:, None], 0)
    out = forward(
        weights,
        prompts.tokens_BP,
        cfg,
        positions_BT=pos_BP,
        segment_ids_BT=real_BP.astype(jnp.int32),
        cache=cache,
        return_qkv_amax=True,
        last_logits_only=True,  # prompts are left-padded: the last position predicts token 0
        kernels=kernels,
        return_expert_ids=record,
    )
    ids = out.expert_ids_BTLK
    if ids is not None:  # the left pads were routed too, but are no tokens of the sequence
        ids = jnp.where(real_BP[:, :, None, None], ids, jnp.int16(REPLAY_NONE))
    return out.logits_BTV[:, -1], out.cache, out.qkv_amax, ids


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
def _generate(weights, prompts, rng, k_scale, v_scale, budget_B=None, *, cfg, sampling,
              cache_dtype, mode, max_new_tokens, stop_ids, kernels, record_expert_ids):  # fmt: skip
    b, p = prompts.tokens_BP.shape
    budget_B = response_budget(budget_B, b, max_new_tokens)
    # The prefill fills a prompt-sized cache (its attention spans P slots, not P + N); the
    # decode loop then gets the response slots.
    cache = init_cache(
        cfg, b, p, dtype=cache_dtype, mode=mode, k_scale=k_scale, v_scale=v_scale
    )  # fmt: skip
    logits_BV, cache, amax, prompt_ids = _prefill(
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
    resp_BA = jnp.arange(max_new_tokens)[None] < state.n_B[:, None]
    ids_BALK = state.ids_BALK
    return Rollout(
        tokens_BT=jnp.concatenate([prompts.tokens_BP, jnp.where(resp_BA, state.out_BA, 0)], 1),
        response_mask_BT=jnp.concatenate([jnp.zeros((b, p), bool), resp_BA], 1),
        logp_BT=jnp.concatenate([jnp.zeros((b, p)), jnp.where(resp_BA, state.logp_BA, 0.0)], 1),
        response_lens_B=state.n_B,
        prompt_lens_B=prompts.lens_B,
        qkv_amax=amax,
        prompt_len=p,
        expert_ids_BTLK=None if prompt_ids is None else jnp.concatenate([prompt_ids, ids_BALK], 1),
    )


def engine_inputs(who, prompts, cfg, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens):
    """The arguments every engine checks alike: ``(Prompts, cache dtype, scale mode
    ("none" | "static" | "dynamic"), k_scale, v_scale)``; errors start with ``who``."""
    if not isinstance(prompts, Prompts):
        prompts = Prompts(*(jnp.asarray(x, jnp.int32) for x in prompts))
    if max_new_tokens < 1:
        raise ValueError(f"{who}: max_new_tokens must be >= 1, got {max_new_tokens}")
    dtype = jnp.dtype(kv_cache_dtype)
    is_fp8 = dtype.name.startswith("float8")
    if is_fp8 and kv_scale_mode not in ("static", "dynamic"):
        raise ValueError(f"{who}: kv_scale_mode must be static|dynamic, got {kv_scale_mode!r}")
    mode = kv_scale_mode if is_fp8 else "none"
    return (prompts, dtype, mode, *_static_scales(kv_scales, cfg, mode))


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
    benchmarks force long-tailed lengths with it).
    """
    prompts, dtype, mode, k_scale, v_scale = engine_inputs(
        "generate", prompts, cfg, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens
    )
    stop_ids = tuple(int(t) for t in stop_token_ids)
    return _generate(
        weights, prompts, rng, k_scale, v_scale, response_budget_B, cfg=cfg, sampling=sampling,
        cache_dtype=dtype, mode=mode, max_new_tokens=int(max_new_tokens), stop_ids=stop_ids,
        kernels=kernels, record_expert_ids=bool(record_expert_ids),
    )  # fmt: skip
