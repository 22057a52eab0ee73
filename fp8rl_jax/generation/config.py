"""``RolloutConfig``: how the rollout policy generates (precision, kernels, sampling, budget)."""

from __future__ import annotations

import dataclasses

from fp8rl_jax.generation.sampling import SamplingConfig
from fp8rl_jax.quant import QuantRecipe
from kernels_pallas.backend import KernelImpls

ENGINES = ("static",)  # rollout engines (generation/rollout.py); "paged" joins here


KV_CACHE_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")


KV_SCALE_MODES = ("static", "dynamic")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How the rollout policy generates: precision of weights and KV cache, sampling, budget."""

    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = 16  # response budget per sequence
    stop_token_ids: tuple[int, ...] = ()  # generation of a row stops after any of these
    quant: QuantRecipe | None = QuantRecipe()  # FP8 W8A8 recipe; None = BF16 rollout
    kv_cache_dtype: str = "bfloat16"  # one of KV_CACHE_DTYPES
    kv_scale_mode: str = "static"  # FP8 KV scales: "static" (recalibrated per step) | "dynamic"
    compute_dtype: str = "bfloat16"  # activations / non-FP8 weights in rollout and scoring
    kv_calib_percentile: float = 99.9  # percentile over micro-batch amax (NeMo-RL)
    kv_calib_margin: float = 1.05  # headroom multiplier on the amax
    matmul_impl: str = (
        "auto"  # W8A8 linear layers: "auto" | "xla" | "pallas_mosaic_gpu" | "pallas_tpu"
    )
    decode_attention_impl: str | None = None  # None: jnp; "auto"/"xla"/"pallas_*": decode kernel op
    engine: str = "static"  # one of ENGINES: "static" = prefill + while_loop decode (``generate``)

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"RolloutConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_scale_mode not in KV_SCALE_MODES:
            raise ValueError(
                f"RolloutConfig.kv_scale_mode must be one of {KV_SCALE_MODES}, "
                f"got {self.kv_scale_mode!r}"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"RolloutConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        KernelImpls(self.matmul_impl, self.decode_attention_impl)  # validates the names
        if self.max_new_tokens < 1:
            raise ValueError(
                f"RolloutConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )

    @property
    def kernels(self) -> KernelImpls:
        """The kernel choices of the rollout program (static)."""
        return KernelImpls(matmul=self.matmul_impl, decode_attention=self.decode_attention_impl)

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("float8")

    @property
    def static_kv_scales(self) -> bool:
        return self.fp8_kv and self.kv_scale_mode == "static"
