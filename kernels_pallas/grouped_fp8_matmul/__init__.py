"""Grouped blockwise FP8 W8A8 matmul for MoE experts (rows sorted by expert, weights
``[E, N, K]``): jnp reference, XLA row-tile path, Mosaic GPU (Hopper) and Mosaic TPU kernels,
and the dispatcher ``grouped_fp8_matmul``."""

from kernels_pallas.grouped_fp8_matmul.api import IMPLEMENTATIONS, grouped_fp8_matmul
from kernels_pallas.grouped_fp8_matmul.pallas_mosaic_gpu import MgpuConfig
from kernels_pallas.grouped_fp8_matmul.pallas_tpu import TpuConfig
from kernels_pallas.grouped_fp8_matmul.reference import (
    grouped_fp8_matmul_reference,
    operand_error,
)
from kernels_pallas.grouped_fp8_matmul.tiles import TileMap, make_tile_map, num_tiles
from kernels_pallas.grouped_fp8_matmul.xla import XlaConfig

__all__ = [
    "IMPLEMENTATIONS",
    "MgpuConfig",
    "TileMap",
    "TpuConfig",
    "XlaConfig",
    "grouped_fp8_matmul",
    "grouped_fp8_matmul_reference",
    "make_tile_map",
    "num_tiles",
    "operand_error",
]
