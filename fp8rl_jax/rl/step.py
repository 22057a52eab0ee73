"""The RL step as two jitted programs: FP8 rollout + BF16 scoring + correction, then the update.

Rollout program (DESIGN.md §2, steps 1-4): quantize the current params (the per-step "weight
sync"), generate with the FP8 or BF16 KV cache, score the generated tokens with the
high-precision policy under the same logits processing as sampling (``logp_old`` and the Q/K/V
amax for KV-scale recalibration), and compute the rollout-correction weights and metrics.

Train program (steps 5-7): advantages, ``ppo_epochs`` x minibatches of loss + optax update
(``lax.scan``; FP32 master weights, compute in ``compute_dtype``), and the next rollout's KV
scales from this step's BF16 pass. A non-finite loss, gradient or update skips the update and is
counted.

With a reward that is a JAX function, ``make_fused_step`` composes both (and the reward) into one
program; ``rollout_fn``/``train_fn`` are the un-jitted pieces all three builders share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.generation import (
    KVScales,
    Prompts,
    SamplingConfig,
    calibrate_kv_scales,
    generate,
    token_logprobs,
)
from fp8rl_jax.models import ModelConfig, forward
from fp8rl_jax.quant import QuantRecipe, quantize_params
from fp8rl_jax.rl.advantages import grpo_advantages, rloo_advantages
from fp8rl_jax.rl.correction import RolloutCorrectionConfig, rollout_correction
from fp8rl_jax.rl.losses import LossConfig, masked_mean, policy_loss

ADVANTAGES = ("grpo", "drgrpo", "rloo")
KV_CACHE_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
KV_SCALE_MODES = ("static", "dynamic")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How the rollout policy generates: precision of weights and KV cache, sampling, budget."""

    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = 16  # response budget per sequence
    stop_token_ids: tuple[int, ...] = ()  # generation of a row stops after any of these
    quant: QuantRecipe | None = QuantRecipe()  # FP8 W8A8 recipe; None = BF16 rollout
    kv_cache_dtype: str = "bfloat16"  # one of KV_CACHE_DTYPES
    kv_scale_mode: str = "static"  # FP8 KV scales: "static" (recalibrated per step) | "dynamic"
    compute_dtype: str = "bfloat16"  # activations / non-FP8 weights in rollout and scoring
    kv_calib_percentile: float = 99.9  # percentile over micro-batch amax (NeMo-RL)
    kv_calib_margin: float = 1.05  # headroom multiplier on the amax
    decode_attention_impl: str | None = None  # None: jnp; "auto"/"pallas_*": Pallas decode kernel

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"RolloutConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_scale_mode not in KV_SCALE_MODES:
            raise ValueError(
                f"RolloutConfig.kv_scale_mode must be one of {KV_SCALE_MODES}, "
                f"got {self.kv_scale_mode!r}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(
                f"RolloutConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("float8")

    @property
    def static_kv_scales(self) -> bool:
        return self.fp8_kv and self.kv_scale_mode == "static"


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The algorithm: advantages, PPO epochs/minibatches, loss, rollout correction."""

    group_size: int = 8  # G responses per prompt (GRPO group)
    advantage: str = "grpo"  # "grpo" | "drgrpo" (no std division) | "rloo"
    ppo_epochs: int = 1  # passes over the rollout batch
    num_minibatches: int = 1  # optimizer updates per epoch
    grad_accum: int = 1  # micro-batches accumulated per minibatch update
    loss: LossConfig = LossConfig()
    correction: RolloutCorrectionConfig = RolloutCorrectionConfig()

    def __post_init__(self):
        if self.advantage not in ADVANTAGES:
            raise ValueError(
                f"RLConfig.advantage must be one of {ADVANTAGES}, got {self.advantage!r}"
            )
        for name in ("group_size", "ppo_epochs", "num_minibatches", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step needs and a checkpoint saves; donated to the train program."""

    params: dict  # FP32 master weights
    opt_state: optax.OptState
    kv_scales: KVScales | None  # static FP8 KV scales for the next rollout (None: not used)
    step: jax.Array  # int32 number of completed RL steps
    rng: jax.Array  # base key; step t uses fold_in(rng, t)
    nonfinite_skips: jax.Array  # int32 updates skipped for a non-finite loss, gradient or update


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One rollout, scored and corrected, ready for the update (all arrays [B, T] unless noted)."""

    tokens_BT: jax.Array  # prompt + response, left-padded prompts
    segment_ids_BT: jax.Array  # 1 for real tokens, 0 for left padding
    positions_BT: jax.Array  # per-row positions (left-padding invariant)
    response_mask_BT: jax.Array  # 1 on generated tokens up to and including the stop token
    logp_rollout_BT: jax.Array  # rollout (FP8) policy log-probs of the sampled tokens
    logp_old_BT: jax.Array  # high-precision policy log-probs at the params that generated
    is_weights_BT: jax.Array  # rollout-correction importance weights (stop-gradient)
    keep_BT: jax.Array  # rollout-correction keep mask (MIS / rejection)
    qkv_amax: dict  # per-layer Q/K/V amax of the scoring pass, for KV-scale recalibration
    metrics: dict  # rollout-correction and generation metrics (device scalars)


class _MiniBatch(NamedTuple):
    tokens_BT: jax.Array
    segment_ids_BT: jax.Array
    positions_BT: jax.Array
    mask_BT: jax.Array
    logp_old_BT: jax.Array
    advantages_BT: jax.Array
    is_weights_BT: jax.Array
    keep_BT: jax.Array


def rollout_segment_ids(ro) -> jax.Array:
    """1 on real tokens (the prompt without its left padding, and the response), else 0."""
    T = ro.tokens_BT.shape[1]
    t_T = jnp.arange(T)[None, :]
    start_B1 = (ro.prompt_len - ro.prompt_lens_B)[:, None]
    end_B1 = (ro.prompt_len + ro.response_lens_B)[:, None]
    return ((t_T >= start_B1) & (t_T < end_B1)).astype(jnp.int32)


def prompt_segment_ids(prompts: Prompts) -> jax.Array:
    """1 on real prompt tokens, 0 on the left padding."""
    P = prompts.tokens_BP.shape[1]
    return (jnp.arange(P)[None, :] >= P - prompts.lens_B[:, None]).astype(jnp.int32)


def cast_floats(tree, dtype):
    """Casts floating leaves (weights) to ``dtype``; integer leaves pass."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def sequence_logprobs(
    params, tokens_BT, positions_BT, segment_ids_BT, model_cfg, sampling, *, with_amax=False
):
    """``logp[b, t] = log q(tokens[b, t] | tokens[b, :t])`` under ``sampling``'s processing.

    Position 0 has no prediction and gets 0. Also returns the forward outputs (logits, Q/K/V amax
    when ``with_amax``, router aux loss).
    """
    out = forward(
        params,
        tokens_BT,
        model_cfg,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        return_qkv_amax=with_amax,
    )
    logp = token_logprobs(out.logits_BTV[:, :-1], tokens_BT[:, 1:], sampling)
    logp_BT = jnp.pad(logp, ((0, 0), (1, 0)))
    return logp_BT, out


def rollout_fn(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    *,
    constrain_rollout_params: Callable | None = None,
) -> Callable[[TrainState, Prompts], RolloutBatch]:
    """Un-jitted ``rollout_step(state, prompts) -> RolloutBatch`` (steps 1-4), for composing.

    ``constrain_rollout_params`` (e.g. ``train.sharding.rollout_params_constraint``) pins the
    quantized weights to the rollout layout, so FSDP gathers run once per step, not per token.
    """
    compute_dtype = jnp.dtype(rollout_cfg.compute_dtype)

    def rollout_step(state: TrainState, prompts: Prompts) -> RolloutBatch:
        params = cast_floats(state.params, compute_dtype)
        rollout_params, qstats = quantize_params(params, rollout_cfg.quant, return_stats=True)
        if constrain_rollout_params is not None:  # gather FP8 weights once, not per token
            rollout_params = constrain_rollout_params(rollout_params)
        # Stream 0 of step t samples the rollout; stream 1 shuffles the minibatches.
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 0)
        ro = generate(
            rollout_params,
            prompts,
            model_cfg,
            rollout_cfg.sampling,
            rng,
            kv_cache_dtype=rollout_cfg.kv_cache_dtype,
            kv_scale_mode=rollout_cfg.kv_scale_mode,
            kv_scales=state.kv_scales if rollout_cfg.static_kv_scales else None,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop_token_ids=rollout_cfg.stop_token_ids,
            decode_impl=rollout_cfg.decode_attention_impl,
        )
        segment_ids_BT = rollout_segment_ids(ro)
        positions_BT = jnp.maximum(jnp.cumsum(segment_ids_BT, axis=1) - 1, 0)
        mask_BT = ro.response_mask_BT.astype(jnp.float32)
        # The scoring pass runs in bypass mode too: it gives the Q/K/V amax and lets the metrics
        # still measure the mismatch; bypass only changes which log-probs act as pi_old.
        logp_hp_BT, out = sequence_logprobs(
            params,
            ro.tokens_BT,
            positions_BT,
            segment_ids_BT,
            model_cfg,
            rollout_cfg.sampling,
            with_amax=True,
        )
        logp_hp_BT = jnp.where(mask_BT > 0, logp_hp_BT, 0.0)
        logp_old_BT = ro.logp_BT if rl_cfg.correction.bypass else logp_hp_BT
        is_w, keep, metrics = rollout_correction(logp_hp_BT, ro.logp_BT, mask_BT, rl_cfg.correction)
        metrics = dict(metrics)
        metrics["response_len_mean"] = jnp.mean(ro.response_lens_B.astype(jnp.float32))
        metrics["quant_nonfinite"] = qstats.nonfinite
        return RolloutBatch(
            tokens_BT=ro.tokens_BT,
            segment_ids_BT=segment_ids_BT,
            positions_BT=positions_BT,
            response_mask_BT=mask_BT,
            logp_rollout_BT=ro.logp_BT,
            logp_old_BT=logp_old_BT,
            is_weights_BT=is_w,
            keep_BT=keep.astype(jnp.float32),
            qkv_amax=out.qkv_amax,
            metrics=metrics,
        )

    return rollout_step


def make_rollout_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    *,
    constrain_rollout_params: Callable | None = None,
) -> Callable[[TrainState, Prompts], RolloutBatch]:
    """``rollout_step(state, prompts) -> RolloutBatch``, one jitted program (see ``rollout_fn``)."""
    return jax.jit(
        rollout_fn(
            model_cfg, rollout_cfg, rl_cfg, constrain_rollout_params=constrain_rollout_params
        )
    )


def compute_advantages(rewards_B, mask_BT, rl_cfg: RLConfig):
    """Per-token advantages from sequence rewards (GRPO, Dr.GRPO or RLOO)."""
    if rl_cfg.advantage == "rloo":
        return rloo_advantages(rewards_B, mask_BT, rl_cfg.group_size)
    return grpo_advantages(
        rewards_B, mask_BT, rl_cfg.group_size, scale_by_std=rl_cfg.advantage == "grpo"
    )


def _split_minibatches(mb: _MiniBatch, n: int, rng) -> _MiniBatch:
    """Shuffles rows and reshapes every field to [n, B/n, ...]."""
    B = mb.tokens_BT.shape[0]
    perm = jax.random.permutation(rng, B)
    return jax.tree.map(lambda x: x[perm].reshape(n, B // n, *x.shape[1:]), mb)


def train_fn(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
) -> Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]:
    """Un-jitted ``train_step(state, batch, rewards_B) -> (state', metrics)`` (steps 5-7)."""
    compute_dtype = jnp.dtype(rollout_cfg.compute_dtype)
    n_mb, n_acc = rl_cfg.num_minibatches, rl_cfg.grad_accum

    def loss_fn(params, mb: _MiniBatch):
        logp_BT, out = sequence_logprobs(
            cast_floats(params, compute_dtype),
            mb.tokens_BT,
            mb.positions_BT,
            mb.segment_ids_BT,
            model_cfg,
            rollout_cfg.sampling,
        )
        loss, metrics = policy_loss(
            logp_BT,
            mb.logp_old_BT,
            mb.advantages_BT,
            mb.mask_BT,
            mb.is_weights_BT,
            mb.keep_BT,
            rl_cfg.loss,
        )
        if model_cfg.num_experts:
            loss = loss + model_cfg.router_aux_loss_coef * out.aux_loss
            metrics = {**metrics, "router_aux_loss": out.aux_loss}
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def minibatch_grads(params, mb: _MiniBatch):
        micro = jax.tree.map(lambda x: x.reshape(n_acc, x.shape[0] // n_acc, *x.shape[1:]), mb)

        def acc(carry, m):
            (loss, metrics), g = grad_fn(params, m)
            return jax.tree.map(jnp.add, carry, (loss, metrics, g)), None

        (loss0, met0), g0 = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
        if n_acc > 1:
            rest = jax.tree.map(lambda x: x[1:], micro)
            (loss0, met0, g0), _ = jax.lax.scan(acc, (loss0, met0, g0), rest)
        scale = 1.0 / n_acc
        return jax.tree.map(lambda x: x * scale, (loss0, met0, g0))

    def update(carry, mb: _MiniBatch):
        params, opt_state, skips = carry
        loss, metrics, grads = minibatch_grads(params, mb)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        # The updates are checked too: finite gradients can still give a non-finite step (an
        # inf learning rate, an optimizer-state overflow), which must not reach the params.
        finite = (
            jnp.isfinite(loss)
            & jnp.isfinite(optax.global_norm(grads))
            & jnp.isfinite(optax.global_norm(updates))
        )
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jax.tree.map(
            lambda n, o: jnp.where(finite, n, o), (new_params, new_opt), (params, opt_state)
        )
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
        return (params, opt_state, skips + (~finite).astype(jnp.int32)), metrics

    def train_step(state: TrainState, batch: RolloutBatch, rewards_B: jax.Array):
        mask_BT = batch.response_mask_BT
        adv_BT = compute_advantages(rewards_B.astype(jnp.float32), mask_BT, rl_cfg)
        data = _MiniBatch(
            batch.tokens_BT,
            batch.segment_ids_BT,
            batch.positions_BT,
            mask_BT,
            batch.logp_old_BT,
            adv_BT,
            batch.is_weights_BT,
            batch.keep_BT,
        )
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
        epochs = jax.vmap(lambda k: _split_minibatches(data, n_mb, k))(
            jax.random.split(rng, rl_cfg.ppo_epochs)
        )
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), epochs)
        (params, opt_state, skips), mb_metrics = jax.lax.scan(
            update, (state.params, state.opt_state, state.nonfinite_skips), flat
        )
        kv_scales = state.kv_scales
        if rollout_cfg.static_kv_scales:
            kv_scales = calibrate_kv_scales(
                batch.qkv_amax,
                rollout_cfg.kv_calib_percentile,
                rollout_cfg.kv_calib_margin,
                previous=state.kv_scales,
            )
        metrics = {k: jnp.mean(v) for k, v in mb_metrics.items()}
        metrics["reward_mean"] = jnp.mean(rewards_B)
        metrics["advantage_abs_mean"] = masked_mean(jnp.abs(adv_BT), mask_BT)
        metrics["nonfinite_skips"] = skips
        new_state = dataclasses.replace(
            state,
            params=params,
            opt_state=opt_state,
            kv_scales=kv_scales,
            step=state.step + 1,
            nonfinite_skips=skips,
        )
        return new_state, metrics

    return train_step


def make_train_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
) -> Callable[[TrainState, RolloutBatch, jax.Array], tuple[TrainState, dict]]:
    """``train_step(state, batch, rewards_B) -> (state', metrics)``, jitted, state donated."""
    return jax.jit(train_fn(model_cfg, rollout_cfg, rl_cfg, optimizer), donate_argnums=(0,))


RewardFn = Callable[[jax.Array, jax.Array, object], jax.Array]


def make_fused_step(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    rl_cfg: RLConfig,
    optimizer: optax.GradientTransformation,
    reward_fn: RewardFn,
) -> Callable[[TrainState, Prompts, object], tuple[TrainState, RolloutBatch, dict]]:
    """Steps 1-7 as one jitted program, for rewards that are JAX functions (DESIGN.md §2).

    ``reward_fn(tokens_BT, response_mask_BT, prompt_data) -> rewards_B`` runs in-graph between
    the rollout and the update; ``prompt_data`` is any pytree of per-row arrays (targets, ...).
    Returns ``fused_step(state, prompts, prompt_data) -> (state', batch, metrics)``, state
    donated; ``metrics`` holds the rollout and the train metrics.
    """
    rollout_step = rollout_fn(model_cfg, rollout_cfg, rl_cfg)
    train_step = train_fn(model_cfg, rollout_cfg, rl_cfg, optimizer)

    def fused_step(state: TrainState, prompts: Prompts, prompt_data):
        batch = rollout_step(state, prompts)
        rewards_B = reward_fn(batch.tokens_BT, batch.response_mask_BT, prompt_data)
        new_state, train_metrics = train_step(state, batch, rewards_B)
        return new_state, batch, {**batch.metrics, **train_metrics}

    return jax.jit(fused_step, donate_argnums=(0,))


def calibrate_initial_kv_scales(
    params, prompts: Prompts, model_cfg, rollout_cfg
) -> KVScales | None:
    """Step 0 (DESIGN.md §4.5): KV scales from a high-precision pass over the prompts."""
    if not rollout_cfg.static_kv_scales:
        return None
    seg = prompt_segment_ids(prompts)
    pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
    out = jax.jit(
        lambda p, t, q, s: forward(
            p, t, model_cfg, positions_BT=q, segment_ids_BT=s, return_qkv_amax=True
        )
    )(cast_floats(params, rollout_cfg.compute_dtype), prompts.tokens_BP, pos, seg)
    return calibrate_kv_scales(
        out.qkv_amax, rollout_cfg.kv_calib_percentile, rollout_cfg.kv_calib_margin
    )


def init_train_state(params, optimizer, rng, kv_scales: KVScales | None = None) -> TrainState:
    """FP32 master weights, fresh optimizer state, step 0."""
    # A copy: the train program donates the state, which must not delete the caller's arrays.
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        kv_scales=kv_scales,
        step=jnp.zeros((), jnp.int32),
        rng=rng,
        nonfinite_skips=jnp.zeros((), jnp.int32),
    )
