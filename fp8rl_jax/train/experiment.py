"""The typed experiment: what a config file describes, as frozen dataclasses built once.

``experiments/train.py`` turns the ``ml_collections.ConfigDict`` of a config file into an
``Experiment`` here (validated, with errors naming the field); the library never sees a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from fp8rl_jax.fields import check_choices
from fp8rl_jax.generation import RolloutConfig, check_engine
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.models.config import ARCHITECTURES
from fp8rl_jax.rl import RLConfig
from fp8rl_jax.tasks import DATA_FORMATS, VERIFIERS
from fp8rl_jax.train.distributed import DistributedConfig
from fp8rl_jax.train.logging import LOGGERS
from fp8rl_jax.train.optim import OptimConfig
from fp8rl_jax.train.sft import SFTConfig
from fp8rl_jax.train.sharding.mesh import MeshConfig

Architecture = Literal[tuple(ARCHITECTURES)]  # the HF classes models.ModelConfig supports
DataFormat = Literal[DATA_FORMATS]  # math task data files (tasks.datasets)
Verifier = Literal[VERIFIERS]  # math task answer checkers (tasks.verifiers)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A local HF checkpoint, or a tiny random model built from the fields below.

    The tiny-model fields are ``models.ModelConfig`` fields of the same name and meaning (D, L,
    H, K, C, F, E are DESIGN.md's axis letters); ``tiny_config`` copies them over and adds the
    vocabulary size and what the architecture implies (QK-norm for Qwen3, QKV bias for Qwen2).
    """

    hf_checkpoint: str = ""  # local HF directory (config.json + *.safetensors); "" = tiny model
    architecture: Architecture = "Qwen3ForCausalLM"  # tiny model: HF class it mimics
    hidden_size: int = 64  # D
    num_layers: int = 2  # L
    num_heads: int = 4  # H (query heads)
    num_kv_heads: int = 2  # K (GQA key/value heads)
    head_dim: int = 16  # C
    intermediate_size: int = 256  # F (dense MLP)
    num_experts: int = 0  # E (0 = dense; > 0 needs architecture Qwen3MoeForCausalLM)
    num_experts_per_tok: int = 2  # MoE top-k
    moe_intermediate_size: int = 64  # F of each expert
    tie_word_embeddings: bool = True  # share embedding and lm_head
    max_position_embeddings: int = 512  # RoPE table length

    def __post_init__(self):
        check_choices(self)
        sizes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "max_position_embeddings")  # fmt: skip
        if self.num_experts:
            sizes += ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of "
                f"model.num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"model.num_experts={self.num_experts}"
            )
        if self.hf_checkpoint and not os.path.isdir(self.hf_checkpoint):
            raise ValueError(f"model.hf_checkpoint: no such directory {self.hf_checkpoint!r}")
        if self.num_experts and self.architecture != "Qwen3MoeForCausalLM":
            raise ValueError("model.num_experts > 0 needs architecture='Qwen3MoeForCausalLM'")

    def tiny_config(self, vocab_size: int) -> ModelConfig:
        """The ``ModelConfig`` of the tiny model for a tokenizer of ``vocab_size`` ids."""
        shared = {f.name for f in dataclasses.fields(ModelConfig)}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        cfg = {k: v for k, v in fields.items() if k in shared}
        if not self.num_experts:  # a dense model has no top-k or expert width
            cfg.update(num_experts_per_tok=0, moe_intermediate_size=0)
        return ModelConfig(
            vocab_size=vocab_size,
            qk_norm=self.architecture.startswith("Qwen3"),
            qkv_bias=self.architecture == "Qwen2ForCausalLM",
            **cfg,
        )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Which verifiable task the policy is trained on.

    A veRL parquet file (DAPO-Math-17k, veRL's gsm8k): question_key="prompt",
    answer_key="reward_model.ground_truth", data_source_key="data_source",
    extra_info_key="extra_info"; veRL's DAPO reward: verifier="dapo", native_reward=True.
    """

    name: str = "addition"  # a built-in task (fp8rl_jax.tasks.TASKS) or "math" (a data file)
    digits: int = 2  # arithmetic tasks: operand digits
    seed: int = 0  # problem generator seed
    format_reward: float = 0.0  # reward for a well-formed but wrong answer
    min_steps: int = 25  # chain task: fewest subtractions written (response length knob)
    max_steps: int = 75  # chain task: most subtractions written (3-digit values: 4 tokens each)
    max_stride: int = 9  # chain task: the stride k is uniform in [1, max_stride]
    partial_credit: float = 0.0  # chain task: a wrong chain's reward per share of right steps
    jsonl_path: str = ""  # math task: local data file, JSONL or (veRL) parquet
    eval_jsonl_path: str = ""  # math task: held-out file; "" = hold out eval_fraction of train
    eval_fraction: float = 0.1  # math task without an eval file: share of questions held out
    data_format: DataFormat = (
        "auto"  # math task: "auto" (from the file extension) | jsonl | parquet
    )
    question_key: str = "question"  # math task: field of the prompt (string or chat messages)
    answer_key: str = "answer"  # math task: field of the ground truth (dotted = nested)
    data_source_key: str = ""  # math task: field of the data source; "" = not read
    extra_info_key: str = ""  # math task: field of the extra info (an object); "" = not read
    verifier: Verifier = "boxed"  # math task: "boxed" | "dapo" | "math_verify"
    native_reward: bool = False  # math task: the verifier's own rewards (dapo: +1 / -1)
    tokenizer_path: str = ""  # HF tokenizer dir (with an HF checkpoint); "" = character tokenizer

    def __post_init__(self):
        check_choices(self)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The host loop: how long, how much per step, and what is written where."""

    run_dir: str = "runs/default"  # outputs: config, metrics, TensorBoard, checkpoints, plots
    seed: int = 0  # model init, rollout sampling and shuffling
    steps: int = 300  # RL steps
    prompts_per_step: int = 32  # distinct prompts per step (x group_size responses)
    eval_every: int = 50  # greedy held-out accuracy every N steps (0 = only at the end)
    eval_size: int = 256  # held-out problems per evaluation
    checkpoint_every: int = 50  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 3  # newest checkpoints kept
    max_nonfinite_skips: int = 5  # stop when more updates than this were skipped as non-finite
    plots: bool = True  # write PNG plots at the end
    loggers: tuple[str, ...] = ("jsonl", "tensorboard")  # "jsonl" + tensorboard and/or wandb
    allow_cpu: bool = True  # False: stop when jax finds only CPU devices (GPU/TPU recipes)

    def __post_init__(self):
        if "jsonl" not in self.loggers or any(name not in LOGGERS for name in self.loggers):
            raise ValueError(
                f"trainer.loggers must include 'jsonl' and be among {LOGGERS}, got {self.loggers!r}"
            )
        for name in ("steps", "prompts_per_step", "eval_size", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "max_nonfinite_skips"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything one run needs, validated."""

    model: ModelSpec = ModelSpec()  # the policy: an HF checkpoint or a tiny random model
    task: TaskSpec = TaskSpec()  # the verifiable-reward task and its tokenizer
    sft: SFTConfig = SFTConfig()  # supervised warm start before RL (0 steps = none)
    rollout: RolloutConfig = RolloutConfig()  # rollout precision, kernels, sampling, budget
    rl: RLConfig = RLConfig()  # the algorithm: advantages, PPO epochs, loss, correction
    optim: OptimConfig = OptimConfig()  # the RL optimizer (the paper's recipe by default)
    trainer: TrainerConfig = TrainerConfig()  # the host loop: steps, batch, eval, checkpoints
    mesh: MeshConfig = MeshConfig()  # device mesh (docs/SCALING.md); all 1 = one device
    distributed: DistributedConfig = DistributedConfig()  # jax.distributed (multi-host)

    def __post_init__(self):
        check_cross_field_rules(self)
        if self.rl.dapo.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"rl.dapo.overlong_buffer ({self.rl.dapo.overlong_buffer}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}): DAPO's length "
                "penalty window lies inside the response budget"
            )
        rows = self.trainer.prompts_per_step * self.rl.group_size
        parts = self.rl.num_minibatches * self.rl.grad_accum
        if rows % parts:
            raise ValueError(
                f"rl.num_minibatches={self.rl.num_minibatches} x rl.grad_accum="
                f"{self.rl.grad_accum} must divide the {rows} rows of a step "
                f"(trainer.prompts_per_step={self.trainer.prompts_per_step} x "
                f"rl.group_size={self.rl.group_size})"
            )
        gen_rows = (self.rl.dapo.gen_prompts or self.trainer.prompts_per_step) * self.rl.group_size
        micro = self.rl.score_micro_batch
        for n_rows in {rows, gen_rows}:
            if 0 < micro < n_rows and n_rows % micro:
                raise ValueError(
                    f"rl.score_micro_batch={micro} must divide the {n_rows} "
                    "rows a rollout scores (trainer.prompts_per_step or rl.dapo.gen_prompts x "
                    f"rl.group_size={self.rl.group_size})"
                )
        moe = self.model.num_experts > 0
        check_engine(self.rollout, router_replay=self.rl.router_replay == "replay" and moe)
        c = self.rl.correction
        if c.bypass and c.rs_level is not None:
            raise ValueError(
                f"rl.correction.bypass=True makes every ratio 1, so rejection "
                f"(rl.correction.rs_level={c.rs_level!r}) would reject nothing; set rs_level=None "
                "or bypass=False"
            )


GROUP_ADVANTAGES = ("grpo", "drgrpo", "rloo")  # baselines from the other responses of a group


def check_cross_field_rules(exp: Experiment) -> None:
    """Rules between fields that would otherwise fail only after the run started (SFT done,
    programs compiled, files written): each raises ``ValueError`` naming every field involved.
    """
    rl, ro, tc = exp.rl, exp.rollout, exp.trainer
    if rl.group_size < 2 and rl.advantage in GROUP_ADVANTAGES:
        raise ValueError(
            f"rl.group_size={rl.group_size} with rl.advantage={rl.advantage!r}: a group-relative "
            "advantage compares the responses to one prompt, so it needs rl.group_size >= 2 "
            "(or rl.advantage='gae')"
        )
    if rl.dapo.dynamic_sampling and rl.group_size < 2:
        raise ValueError(
            f"rl.dapo.dynamic_sampling=True with rl.group_size={rl.group_size}: a group of one "
            "response never has differing rewards, so every group would be filtered out"
        )
    if rl.dapo.dynamic_sampling and 0 < rl.dapo.gen_prompts < tc.prompts_per_step:
        raise ValueError(
            f"rl.dapo.gen_prompts={rl.dapo.gen_prompts} is less than trainer.prompts_per_step="
            f"{tc.prompts_per_step}: a generation batch must be able to fill the train batch "
            "(set gen_prompts >= prompts_per_step, or 0 for the same)"
        )
    if ro.static_kv_scales and not 0.0 < ro.kv_calib_percentile <= 100.0:
        raise ValueError(
            f"rollout.kv_calib_percentile={ro.kv_calib_percentile} must be in (0, 100] with "
            f"rollout.kv_cache_dtype={ro.kv_cache_dtype!r} and kv_scale_mode='static'"
        )
    if ro.static_kv_scales and not ro.kv_calib_margin > 0.0:
        raise ValueError(
            f"rollout.kv_calib_margin={ro.kv_calib_margin} must be > 0 with "
            f"rollout.kv_cache_dtype={ro.kv_cache_dtype!r} and kv_scale_mode='static'"
        )
    pg = ro.paged
    if ro.engine == "paged" and pg.num_pages is not None:
        # A request holds its shared prompt page(s) (>= 1) and the pages of prompt + response.
        least = -(-(1 + ro.max_new_tokens) // pg.page_size) + 1
        if pg.num_pages < least:
            raise ValueError(
                f"rollout.paged.num_pages={pg.num_pages} cannot hold one request of "
                f"rollout.max_new_tokens={ro.max_new_tokens} tokens (+ a prompt) in pages of "
                f"rollout.paged.page_size={pg.page_size}: it needs at least {least} pages"
            )
    if exp.task.name == "math":
        if not exp.task.jsonl_path:
            raise ValueError("task.name='math' needs task.jsonl_path (its data file)")
        if not exp.task.tokenizer_path and not exp.model.hf_checkpoint:
            raise ValueError(
                "task.name='math' needs an HF tokenizer: task.tokenizer_path or model.hf_checkpoint"
            )


# Fields a config may leave as a None placeholder that the user must fill in.
REQUIRED_IF_NONE = (
    ("model", "hf_checkpoint", "/path/to/hf_checkpoint_dir"),
    ("task", "jsonl_path", "/path/to/train.jsonl"),
    ("task", "tokenizer_path", "/path/to/tokenizer_dir"),
)


def check_override(path: str) -> None:
    """Raises ``ConfigError`` when ``--config.<path>=...`` names no field of an ``Experiment``."""
    from fp8rl_jax.train.config import check_field_path

    check_field_path(Experiment, path, extra=("rollout.quant.enabled",))


def experiment_from_config(config) -> Experiment:
    """Validated ``Experiment`` from a ConfigDict (or mapping); errors name the field path."""
    from fp8rl_jax.train.config import ConfigError, from_config_dict

    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for section, name, example in REQUIRED_IF_NONE:
        if raw.get(section, {}).get(name, "") is None:
            raise ConfigError(
                f"config.{section}.{name} is required: pass --config.{section}.{name}={example}"
            )
    rollout = dict(raw.get("rollout", {}))
    quant = dict(rollout.get("quant", {}))
    enabled = quant.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"config.rollout.quant.enabled: expected a bool, got {enabled!r}")
    rollout["quant"] = quant if enabled else None
    raw["rollout"] = rollout
    return from_config_dict(Experiment, raw, "config")
