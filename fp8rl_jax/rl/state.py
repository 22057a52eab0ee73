"""What the RL step programs carry: the algorithm config, the train state, a rollout batch."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.fields import batched, check_choices
from fp8rl_jax.generation import KVScales, RolloutConfig
from fp8rl_jax.models import ModelConfig, QKVAmax, Remat
from fp8rl_jax.rl.correction import RolloutCorrectionConfig
from fp8rl_jax.rl.dapo import DAPOConfig
from fp8rl_jax.rl.losses import LossConfig
from fp8rl_jax.rl.value import init_value_head
from kernels_pallas.backend import Impl, KernelImpls

Advantage = Literal["grpo", "drgrpo", "rloo", "gae"]
ADVANTAGES = typing.get_args(Advantage)
RouterReplay = Literal["none", "replay"]
TrainPrecision = Literal["bf16", "fp8_rollout"]


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The algorithm: advantages, PPO epochs/minibatches, loss, rollout correction."""

    group_size: int = 16  # responses per prompt (the GRPO group)
    advantage: Advantage = "grpo"  # grpo | drgrpo (no std division) | rloo | gae (value head)
    ppo_epochs: int = 1  # passes over the rollout batch
    num_minibatches: int = 1  # optimizer updates per epoch
    grad_accum: int = 1  # micro-batches accumulated per minibatch update
    loss: LossConfig = LossConfig()  # the PPO objective and its optional terms
    correction: RolloutCorrectionConfig = RolloutCorrectionConfig()  # FP8 mismatch correction
    gamma: float = 1.0  # GAE discount per token
    lam: float = 1.0  # GAE λ (1: Monte-Carlo returns minus the value baseline)
    whiten_advantages: bool = True  # GAE: whiten advantages over the batch's response tokens
    kl_in_reward: float = 0.0  # β of the per-token reward penalty −β·KL(π_old‖π_ref); 0: off
    # MoE rollout routing replay (R3, arXiv 2510.11370): "replay" records the rollout's experts
    # per token and layer; the scoring pass and the loss forward route with them. No-op if dense.
    router_replay: RouterReplay = "none"
    dapo: DAPOConfig = DAPOConfig()  # DAPO dynamic sampling, overlong shaping and filtering
    # Numerics of the scoring pass and the loss forward (rl.precision): bf16 = the compute-dtype
    # policy; fp8_rollout = the rollout's own (its FP8 weights, W8A8 1x128 activations, FP8 K/V
    # rounding), gradients straight through the quantizers to the FP32 master weights.
    train_precision: TrainPrecision = "bf16"
    fp8_backward: bool = False  # fp8_rollout: FP8 dgrad/wgrad GEMMs (DeepSeek-V3) instead of BF16
    # Memory knobs; none changes a value (rl.chunked, rl.scoring, models.remat).
    logprob_chunk: int = 0  # tokens per lm-head chunk in scoring and loss (0: all T at once)
    score_micro_batch: int = 0  # rows per scoring forward (0: all rows); must divide the rows
    remat: Remat = "none"  # jax.checkpoint per block in the loss forward: none|block|dots_saveable
    # The BF16 MoE experts of the scoring pass and the loss forward (kernels_pallas.grouped_matmul):
    # auto (Hopper kernels on H100/H200, jax.lax.ragged_dot elsewhere) | xla | pallas_mosaic_gpu
    expert_matmul_impl: Impl = "auto"

    def __post_init__(self):
        check_choices(self)
        for name in ("group_size", "ppo_epochs", "num_minibatches", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("logprob_chunk", "score_micro_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"RLConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"RLConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.kl_in_reward < 0.0:
            raise ValueError(f"RLConfig.kl_in_reward must be >= 0, got {self.kl_in_reward}")
        if self.fp8_backward and self.train_precision != "fp8_rollout":
            raise ValueError(
                "RLConfig.fp8_backward needs train_precision='fp8_rollout' (the FP8 backward GEMMs "
                f"differentiate the FP8 forward), got train_precision={self.train_precision!r}"
            )

    @property
    def kernels(self) -> KernelImpls:
        """The kernel choices of the scoring pass and the loss forward (static)."""
        return KernelImpls(expert_matmul=self.expert_matmul_impl)

    @property
    def uses_ref(self) -> bool:
        """Whether the steps need the reference policy (KL as a loss term or a reward penalty)."""
        return self.loss.kl_coef > 0.0 or self.kl_in_reward > 0.0

    @property
    def uses_value(self) -> bool:
        """Whether the steps need the value head (PPO with GAE)."""
        return self.advantage == "gae"


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static configuration the RL step programs are compiled for."""

    model: ModelConfig  # the policy's architecture
    rollout: RolloutConfig  # how the rollout generates (precision, sampling, budget)
    rl: RLConfig  # the algorithm (advantages, epochs, minibatches, loss, correction)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """Activations and non-FP8 weights in rollout, scoring and the loss forward."""
        return jnp.dtype(self.rollout.compute_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step needs and a checkpoint saves; donated to the train program."""

    params: dict  # FP32 master weights
    opt_state: optax.OptState  # the optimizer's state over ``Trainable(params, value_head)``
    kv_scales: KVScales | None  # static FP8 KV scales for the next rollout (None: not used)
    step: jax.Array  # int32 number of completed RL steps
    rng: jax.Array  # base key; step t uses fold_in(rng, t)
    nonfinite_skips: jax.Array  # int32 updates skipped for a non-finite loss, gradient or update
    # {"w": [D, 1], "b": [1]} FP32, trained with the policy (advantage="gae"); kept out of
    # ``params`` so the policy pytree still matches ``models.logical_axes`` (sharding, eval).
    value_head: dict | None = None
    # Frozen reference policy for the KL terms: one more copy of the weights (4 B/param in FP32,
    # 2 B/param if passed in BF16), read once per step by the rollout program's extra forward.
    ref_params: dict | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One rollout, scored and corrected, ready for the update (``batched()`` fields are [B, T])."""

    tokens_BT: jax.Array = batched()  # prompt + response, left-padded prompts
    segment_ids_BT: jax.Array = batched()  # 1 for real tokens, 0 for left padding
    positions_BT: jax.Array = batched()  # per-row positions (left-padding invariant)
    response_mask_BT: jax.Array = batched()  # 1 on generated tokens, the stop token included
    logp_rollout_BT: jax.Array = batched()  # rollout (FP8) policy log-probs of the samples
    logp_old_BT: jax.Array = batched()  # high-precision log-probs at the generating params
    is_weights_BT: jax.Array = batched()  # rollout-correction importance weights (no grad)
    keep_BT: jax.Array = batched()  # rollout-correction keep mask (MIS / rejection)
    qkv_amax: QKVAmax  # per-layer Q/K/V amax of the scoring pass, for KV-scale recalibration
    metrics: dict  # rollout-correction and generation metrics (device scalars)
    logp_ref_BT: jax.Array | None = batched(default=None)  # reference log-probs (uses_ref)
    values_BT: jax.Array | None = batched(default=None)  # old values V_t (advantage="gae")
    # int16 [B, T, L_moe, k] the rollout's experts (router_replay="replay", MoE models)
    expert_ids_BTLK: jax.Array | None = batched(default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trainable:
    """What the optimizer updates: the policy weights, and the value head when there is one."""

    policy: dict  # FP32 master weights (``TrainState.params``)
    value_head: dict | None = None  # ``TrainState.value_head`` (advantage="gae"), else None

    @classmethod
    def of(cls, state: TrainState) -> Trainable:
        return cls(state.params, state.value_head)


def check_state(state: TrainState, rl_cfg: RLConfig) -> None:
    """Trace-time check that the state holds what ``rl_cfg`` needs."""
    if rl_cfg.uses_ref and state.ref_params is None:
        raise ValueError(
            "KL to a reference policy (loss.kl_coef or kl_in_reward > 0) needs "
            "TrainState.ref_params: build the state with init_train_state(..., rl_cfg=rl_cfg)"
        )
    if rl_cfg.uses_value != (state.value_head is not None):
        raise ValueError(
            'advantage="gae" needs TrainState.value_head, and only it has one: build the state '
            f"with init_train_state(..., rl_cfg=rl_cfg) (advantage={rl_cfg.advantage!r})"
        )


def init_train_state(
    params,
    optimizer,
    rng,
    kv_scales: KVScales | None = None,
    *,
    rl_cfg: RLConfig | None = None,
    ref_params=None,
) -> TrainState:
    """FP32 master weights, fresh optimizer state, step 0; what ``rl_cfg`` needs besides.

    ``advantage="gae"`` adds a zero-initialized value head. KL to a reference (``rl_cfg.uses_ref``)
    keeps ``ref_params`` (default: a frozen FP32 copy of ``params``, +4 B/param; pass BF16
    weights to halve that). ``ref_params`` is kept whenever it is given.
    """
    # A copy: the train program donates the state, which must not delete the caller's arrays.
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    if ref_params is None and rl_cfg is not None and rl_cfg.uses_ref:
        ref_params = params
    if ref_params is not None:
        ref_params = jax.tree.map(lambda x: jnp.array(x, copy=True), ref_params)
    value_head = None
    if rl_cfg is not None and rl_cfg.uses_value:
        value_head = init_value_head(params["embed"].shape[-1])
    return TrainState(
        params=params,
        opt_state=optimizer.init(Trainable(params, value_head)),
        kv_scales=kv_scales,
        step=jnp.zeros((), jnp.int32),
        rng=rng,
        nonfinite_skips=jnp.zeros((), jnp.int32),
        value_head=value_head,
        ref_params=ref_params,
    )
