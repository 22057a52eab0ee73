"""Decoder-only transformers (Llama, Qwen2, Qwen3, Qwen3-MoE) as functions over a weights pytree."""

from fp8rl_jax.models.attention import attention
from fp8rl_jax.models.cache import Cache, CacheStep
from fp8rl_jax.models.config import ModelConfig, RopeConfig
from fp8rl_jax.models.hf import (
    CheckpointError,
    load_fp8_checkpoint,
    load_hf_checkpoint,
    save_fp8_checkpoint,
    save_hf_checkpoint,
)
from fp8rl_jax.models.moe import moe_mlp, moe_mlp_dense_reference
from fp8rl_jax.models.remat import REMAT_POLICIES, Remat
from fp8rl_jax.models.stop_tokens import checkpoint_stop_token_ids
from fp8rl_jax.models.tokenizer import Tokenizer, load_tokenizer
from fp8rl_jax.models.transformer import ForwardOut, QKVAmax, forward, lm_head
from fp8rl_jax.models.weights import init_weights, logical_axes, param_specs, weight_shapes

__all__ = [
    "Cache",
    "CacheStep",
    "CheckpointError",
    "ForwardOut",
    "ModelConfig",
    "QKVAmax",
    "REMAT_POLICIES",
    "Remat",
    "RopeConfig",
    "Tokenizer",
    "attention",
    "checkpoint_stop_token_ids",
    "forward",
    "init_weights",
    "load_fp8_checkpoint",
    "load_hf_checkpoint",
    "lm_head",
    "load_tokenizer",
    "logical_axes",
    "moe_mlp",
    "moe_mlp_dense_reference",
    "param_specs",
    "save_fp8_checkpoint",
    "save_hf_checkpoint",
    "weight_shapes",
]
