"""``RolloutConfig``: how the rollout policy generates (precision, kernels, sampling, budget)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from fp8rl_jax.fields import check_choices
from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.quant import QuantRecipe
from kernels_pallas.backend import Impl, KernelImpls

EngineName = Literal["static", "paged"]  # rollout engines (generation.rollout.ENGINE_IMPLS)
KVCacheDtype = Literal["bfloat16", "float32", "float8_e4m3fn"]
KVScaleMode = Literal["static", "dynamic"]
ComputeDtype = Literal["bfloat16", "float32"]
ENGINES = typing.get_args(EngineName)
KV_CACHE_DTYPES = typing.get_args(KVCacheDtype)
KV_SCALE_MODES = typing.get_args(KVScaleMode)


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """The paged engine's slots and page pool (docs/PAGED_ENGINE.md §6)."""

    num_slots: int | None = None  # U: sequences decoded at once; None: one per request
    page_size: int = 64  # Y: tokens per KV page (a block size of the decode kernels)
    num_pages: int | None = None  # X: pages per layer; None: kv_memory_bytes, else worst case
    kv_memory_bytes: int | None = None  # KV budget (all layers, K and V, scales) -> num_pages
    prefill_batch: int = 16  # prompts prefilled per loop iteration (one compiled shape)

    def __post_init__(self):
        for name in ("num_slots", "page_size", "num_pages", "kv_memory_bytes", "prefill_batch"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"PagedConfig.{name} must be an int >= 1, got {v!r}")
        if self.num_pages is not None and self.kv_memory_bytes is not None:
            raise ValueError("PagedConfig: set num_pages or kv_memory_bytes, not both")


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
    fp8_attention: bool = False  # Q cast to E4M3 with KVScales.q (needs static FP8 KV scales)
    # FP8 q|k|v and gate|up as one GEMM each (``models.fused``): fewer, fuller decode launches
    fuse_projections: bool = True
    engine: EngineName = "static"  # static: dense cache, one batch; paged: page pool, slots
    paged: PagedConfig = PagedConfig()  # the paged engine's slots and page pool

    def __post_init__(self):
        check_choices(self)
        if self.max_new_tokens < 1:
            raise ValueError(
                f"RolloutConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.fp8_attention and not self.static_kv_scales:
            raise ValueError(
                "rollout.fp8_attention needs calibrated static scales: set "
                "rollout.kv_cache_dtype=float8_e4m3fn and rollout.kv_scale_mode=static"
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
