"""Decoder-only transformers (Llama, Qwen2, Qwen3, Qwen3-MoE) as functions over a weights pytree."""

from fp8rl_jax.models.attention import attention
from fp8rl_jax.models.config import ModelConfig, RopeConfig
from fp8rl_jax.models.hf_fp8 import load_fp8_checkpoint, save_fp8_checkpoint
from fp8rl_jax.models.hf_io import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from fp8rl_jax.models.kv_cache import KVCache, extend_cache, init_cache, reset_rows
from fp8rl_jax.models.moe import moe_mlp, moe_mlp_dense_reference
from fp8rl_jax.models.paged_kv_cache import PagedKVCache, init_paged_cache, page_bytes
from fp8rl_jax.models.remat import REMAT_POLICIES, Remat
from fp8rl_jax.models.stop_tokens import checkpoint_stop_token_ids
from fp8rl_jax.models.tokenizer import Tokenizer, load_tokenizer
from fp8rl_jax.models.transformer import ForwardOut, QKVAmax, forward, lm_head
from fp8rl_jax.models.weights import init_weights, logical_axes, param_specs, weight_shapes

__all__ = [
    "CheckpointError",
    "ForwardOut",
    "KVCache",
    "ModelConfig",
    "PagedKVCache",
    "QKVAmax",
    "REMAT_POLICIES",
    "Remat",
    "RopeConfig",
    "Tokenizer",
    "attention",
    "checkpoint_stop_token_ids",
    "extend_cache",
    "forward",
    "init_cache",
    "init_paged_cache",
    "init_weights",
    "load_fp8_checkpoint",
    "load_hf_checkpoint",
    "lm_head",
    "load_tokenizer",
    "logical_axes",
    "moe_mlp",
    "moe_mlp_dense_reference",
    "page_bytes",
    "param_specs",
    "reset_rows",
    "save_fp8_checkpoint",
    "save_hf_checkpoint",
    "weight_shapes",
]
