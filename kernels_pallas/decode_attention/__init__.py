"""Decode (single-query) attention over a BF16 or FP8 KV cache: jnp reference and Pallas kernels."""

from kernels_pallas.decode_attention.api import TABLE, decode_attention
from kernels_pallas.decode_attention.common import DecodeBlocks
from kernels_pallas.decode_attention.reference import (
    decode_attention_reference,
    dequantize_kv,
    live_mask,
)

__all__ = [
    "TABLE",
    "DecodeBlocks",
    "decode_attention",
    "decode_attention_reference",
    "dequantize_kv",
    "live_mask",
]
