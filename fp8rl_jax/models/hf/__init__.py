"""Hugging Face checkpoints: the tensor layout, BF16 and block-FP8 readers/writers, export dirs.

``layout`` (names, shards) <- ``fp8`` (block FP8) <- ``io`` (BF16; dispatches block-FP8 reads
to ``fp8``); ``dir`` (where an export may go) is used by both writers. No module imports one
above it.
"""

from fp8rl_jax.models.hf.dir import ExportDirError
from fp8rl_jax.models.hf.fp8 import is_fp8_checkpoint, load_fp8_checkpoint, save_fp8_checkpoint
from fp8rl_jax.models.hf.io import load_hf_checkpoint, save_hf_checkpoint
from fp8rl_jax.models.hf.layout import CheckpointError, hf_entries
from fp8rl_jax.models.hf.serving import UnservableExportError

__all__ = [
    "CheckpointError",
    "ExportDirError",
    "hf_entries",
    "is_fp8_checkpoint",
    "load_fp8_checkpoint",
    "load_hf_checkpoint",
    "save_fp8_checkpoint",
    "save_hf_checkpoint",
    "UnservableExportError",
]
