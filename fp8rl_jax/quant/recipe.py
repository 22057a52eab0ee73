"""Which weights are quantized, and how: the FP8 recipe as a frozen dataclass."""

from __future__ import annotations

import dataclasses

from kernels_pallas.qarray import fp8_dtype

# Layers that stay high precision (DESIGN.md §4.4): embeddings, lm_head, norms, MoE router, biases.
DEFAULT_EXCLUDE = (r"embed", r"lm_head", r"norm", r"router", r"bias")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """FP8 W8A8 recipe: weight blocks, activation groups, format and exclusions."""

    dtype: str = "float8_e4m3fn"  # FP8 format of weights and activations
    weight_block: tuple[int, int] = (128, 128)  # [in, out] block of one weight scale
    act_group: int = 128  # per-token activation group along K (1 x act_group tiles)
    pow2_scales: bool = False  # round weight scales up to powers of two (UE8M0)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE  # regexes on the weight path; matches stay BF16
    keep_first_n: int = 0  # first N transformer layers stay BF16
    keep_last_n: int = 0  # last N transformer layers stay BF16
    per_tensor: bool = False  # one scale per weight matrix (harsh ablation; overrides weight_block)

    def __post_init__(self):
        fp8_dtype(self.dtype)
        if len(self.weight_block) != 2 or min(self.weight_block) <= 0:
            raise ValueError(
                f"QuantRecipe.weight_block must be two positive ints, got {self.weight_block}"
            )
        if self.act_group <= 0:
            raise ValueError(f"QuantRecipe.act_group must be positive, got {self.act_group}")
        if not self.per_tensor and self.act_group != self.weight_block[0]:
            raise ValueError(
                f"QuantRecipe.act_group ({self.act_group}) must equal weight_block[0] "
                f"({self.weight_block[0]}) so that activation groups align with weight K blocks"
            )
        if self.keep_first_n < 0 or self.keep_last_n < 0:
            raise ValueError("QuantRecipe.keep_first_n/keep_last_n must be >= 0")
