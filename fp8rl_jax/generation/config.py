"""``RolloutConfig``: how the rollout policy generates (precision, kernels, sampling, budget)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from fp8rl_jax.fields import check_choices
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.quant import QuantRecipe
from kernels_pallas.backend import Impl, KernelImpls

Engine = Literal["static"]  # rollout engines (generation/rollout.py); "paged" joins here
KVCacheDtype = Literal["bfloat16", "float32", "float8_e4m3fn"]
KVScaleMode = Literal["static", "dynamic"]
ComputeDtype = Literal["bfloat16", "float32"]
ENGINES = typing.get_args(Engine)
KV_CACHE_DTYPES = typing.get_args(KVCacheDtype)
KV_SCALE_MODES = typing.get_args(KVScaleMode)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How the rollout policy generates: precision of weights and KV cache, sampling, budget."""

    sampling: SamplingConfig = SamplingConfig()  # temperature / top-k / top-p / min-p
    max_new_tokens: int = 16  # response budget per sequence (tokens)
    stop_token_ids: tuple[int, ...] = ()  # generation of a row stops after any of these
    quant: QuantRecipe | None = QuantRecipe()  # FP8 W8A8 recipe; None = BF16 rollout
    kv_cache_dtype: KVCacheDtype = "bfloat16"  # KV cache element type; float8 needs scales
    kv_scale_mode: KVScaleMode = "static"  # FP8 KV: static (recalibrated per step) | dynamic
    compute_dtype: ComputeDtype = "bfloat16"  # activations / non-FP8 weights, rollout + scoring
    kv_calib_percentile: float = 99.9  # percentile over micro-batch amax (NeMo-RL)
    kv_calib_margin: float = 1.05  # headroom multiplier on the amax
    matmul_impl: Impl = "auto"  # W8A8 linear layers: auto | xla | pallas_mosaic_gpu | pallas_tpu
    # decode steps: the length-aware kernel op (auto: Mosaic GPU / TPU kernel where its support
    # check passes, else its XLA path, which reads only the live slots too); None: the model's
    # jnp attention over the whole cache (with a mask)
    decode_attention_impl: Impl | None = "auto"
    grouped_matmul_impl: Impl = "auto"  # FP8 MoE experts (grouped_fp8_matmul): same choices
    engine: Engine = "static"  # static = prefill + while_loop decode over a dense cache

    def __post_init__(self):
        check_choices(self)
        if self.max_new_tokens < 1:
            raise ValueError(
                f"RolloutConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )

    @property
    def kernels(self) -> KernelImpls:
        """The kernel choices of the rollout program (static)."""
        return KernelImpls(
            matmul=self.matmul_impl,
            decode_attention=self.decode_attention_impl,
            grouped_matmul=self.grouped_matmul_impl,
        )

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("float8")

    @property
    def static_kv_scales(self) -> bool:
        return self.fp8_kv and self.kv_scale_mode == "static"
