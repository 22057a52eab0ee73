"""The engine contract: what a rollout engine takes, returns and can do.

An engine (``static.py``: one dense batch; ``paged/``: a page pool with continuous batching) is
``engine(weights, prompts, model_cfg, rollout_cfg, sampling, rng, kv_scales, *,
record_expert_ids) -> (Rollout, metrics)`` with declared ``Capabilities``; a config that asks an
engine for one it lacks is refused at config time (``check_capabilities``). Both engines check
their inputs alike (``engine_inputs``), prefill prompts with ``prefill`` and build their result
with ``make_rollout``; they import this module, never each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fields import batched
from fp8rl_jax.generation.config import RolloutConfig
from fp8rl_jax.generation.kv import KVScales, cdiv
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.models import Cache, ModelConfig, QKVAmax, forward
from fp8rl_jax.models.moe import REPLAY_NONE
from kernels_pallas.backend import KernelImpls

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


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond generating (checked against the config before any trace)."""

    router_replay: bool  # records each token's MoE experts (``record_expert_ids``)
    dynamic_kv_scales: bool  # FP8 KV cache with a scale per cached vector
    response_budgets: bool  # per-request response budgets (``response_budget_B``)
    continuous_batching: bool  # a finished sequence's room goes to the next request


class Engine(Protocol):
    """A rollout engine (``ENGINES`` in ``rollout.py`` maps ``RolloutConfig.engine`` to one)."""

    capabilities: Capabilities

    def __call__(
        self,
        weights: dict,
        prompts: Prompts,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        sampling: SamplingConfig,
        rng: jax.Array,
        kv_scales: KVScales | None,
        *,
        record_expert_ids: bool = False,
        group_size: int = 1,  # rows come in runs of this many identical prompts (a hint)
    ) -> tuple[Rollout, dict]: ...


@dataclasses.dataclass(frozen=True)
class EngineFn:
    """An engine function with its declared capabilities (an ``Engine``)."""

    run: Callable[..., tuple[Rollout, dict]]
    capabilities: Capabilities

    def __call__(self, *args, **kw) -> tuple[Rollout, dict]:
        return self.run(*args, **kw)


def check_capabilities(
    caps: Capabilities, rollout_cfg: RolloutConfig, *, router_replay: bool = False
) -> None:
    """Raises a one-line ``ValueError`` naming both fields when the config asks
    ``rollout.engine`` for a capability it lacks (``router_replay``: the RL step records the
    experts, ``rl.router_replay="replay"`` with a MoE model)."""
    engine = f"rollout.engine={rollout_cfg.engine!r}"
    if router_replay and not caps.router_replay:
        raise ValueError(f"rl.router_replay='replay' (MoE): {engine} cannot record the experts")
    if rollout_cfg.fp8_kv and rollout_cfg.kv_scale_mode == "dynamic" and not caps.dynamic_kv_scales:
        raise ValueError(f"rollout.kv_scale_mode='dynamic': {engine} has no dynamic KV scales")


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= n (a multiple of the largest bucket beyond it)."""
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return cdiv(n, top) * top


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


class EngineInputs(NamedTuple):
    """An engine's checked inputs."""

    prompts: Prompts
    cache_dtype: jnp.dtype
    mode: str  # KV scale mode: "none" | "static" | "dynamic"
    kv_scales: KVScales | None  # the static scales (static mode only)
    q_scale_LK: jax.Array | None  # FP8 attention: Q's static scales (``kv_scales.q``), or None


def engine_inputs(
    who: str, prompts, kv_cache_dtype, kv_scale_mode, kv_scales, max_new_tokens,
    fp8_attention: bool = False,
) -> EngineInputs:  # fmt: skip
    """The arguments every engine checks alike; errors start with ``who``. Scales never default
    to 1.0: a static FP8 cache, or FP8 attention, without ``kv_scales`` raises."""
    if not isinstance(prompts, Prompts):
        prompts = Prompts(*(jnp.asarray(x, jnp.int32) for x in prompts))
    if max_new_tokens < 1:
        raise ValueError(f"{who}: max_new_tokens must be >= 1, got {max_new_tokens}")
    dtype = jnp.dtype(kv_cache_dtype)
    is_fp8 = dtype.name.startswith("float8")
    if is_fp8 and kv_scale_mode not in ("static", "dynamic"):
        raise ValueError(f"{who}: kv_scale_mode must be static|dynamic, got {kv_scale_mode!r}")
    mode = kv_scale_mode if is_fp8 else "none"
    if mode == "static" and kv_scales is None:
        raise ValueError(
            f"{who}: a static FP8 KV cache needs kv_scales (calibrate_kv_scales); scales never "
            "default to 1.0"
        )
    if fp8_attention and kv_scales is None:
        raise ValueError(f"{who}: fp8_attention needs kv_scales (their q: Q's static scales)")
    q = kv_scales.q if fp8_attention else None
    return EngineInputs(prompts, dtype, mode, kv_scales if mode == "static" else None, q)


def response_budget(budget_B, b: int, max_new_tokens: int) -> jax.Array:
    """Per-row response budgets ``min(budget_B, max_new_tokens)`` (None: ``max_new_tokens``)."""
    if budget_B is None:
        return jnp.full((b,), max_new_tokens, jnp.int32)
    return jnp.minimum(jnp.asarray(budget_B, jnp.int32), max_new_tokens)


class Prefill(NamedTuple):
    """What a prefill of left-padded prompts gives."""

    logits_BV: jax.Array  # f32 next-token logits of each prompt (its last position)
    cache: Cache  # the cache holding the prompts
    qkv_amax: QKVAmax  # the prompts' Q/K/V amax
    expert_ids_BPLK: jax.Array | None  # int16 experts of the real prompt tokens (recording)


def prefill(
    weights, prompts: Prompts, model_cfg: ModelConfig, cache: Cache, kernels: KernelImpls,
    record_expert_ids: bool = False,
) -> Prefill:  # fmt: skip
    """Runs the prompts into ``cache``: real token ``i`` of a row has position ``i``, the left
    pads are written but invalid (and their recorded experts are ``REPLAY_NONE``)."""
    b, p = prompts.tokens_BP.shape
    pad_B = p - prompts.lens_B
    t = jnp.arange(p, dtype=jnp.int32)[None]
    real_BP = t >= pad_B[:, None]
    out = forward(
        weights, prompts.tokens_BP, model_cfg, positions_BT=jnp.maximum(t - pad_B[:, None], 0),
        segment_ids_BT=real_BP.astype(jnp.int32), cache=cache, return_qkv_amax=True,
        last_logits_only=True,  # prompts are left-padded: the last position predicts token 0
        kernels=kernels, return_expert_ids=record_expert_ids,
    )  # fmt: skip
    ids = out.expert_ids_BTLK
    if ids is not None:  # the left pads were routed too, but are no tokens of the sequence
        ids = jnp.where(real_BP[:, :, None, None], ids, jnp.int16(REPLAY_NONE))
    return Prefill(out.logits_BTV[:, -1], out.cache, out.qkv_amax, ids)


def make_rollout(
    prompts: Prompts, out_BA, logp_BA, lens_B, qkv_amax: QKVAmax, expert_ids_BTLK=None
) -> Rollout:
    """The ``Rollout`` of response tokens ``out_BA`` (and their log-probs) of lengths ``lens_B``
    after ``prompts``; slots past a row's length are 0 and off the response mask."""
    b, p = prompts.tokens_BP.shape
    resp_BA = jnp.arange(out_BA.shape[1])[None] < lens_B[:, None]
    return Rollout(
        tokens_BT=jnp.concatenate([prompts.tokens_BP, jnp.where(resp_BA, out_BA, 0)], 1),
        response_mask_BT=jnp.concatenate([jnp.zeros((b, p), bool), resp_BA], 1),
        logp_BT=jnp.concatenate([jnp.zeros((b, p)), jnp.where(resp_BA, logp_BA, 0.0)], 1),
        response_lens_B=lens_B,
        prompt_lens_B=prompts.lens_B,
        qkv_amax=qkv_amax,
        prompt_len=p,
        expert_ids_BTLK=expert_ids_BTLK,
    )
