"""Shared pieces of the performance model: chips, cases, predictions, the table.

Interface between the GPU half (``gpu.py``, its cases in ``gpu_targets.py``) and the TPU half
(``tpu.py``):

  * each half exposes ``CASES: list[Case]`` (what it predicts) and a predictor
    ``predict_gpu(op, shape, chip) -> Prediction`` / ``predict_tpu(op, shape, chip) -> Prediction``
    where ``op`` is a kernel package name (``"fp8_matmul"``, ``"grouped_fp8_matmul"``,
    ``"decode_attention"``, ``"paged_attention"``), ``shape`` a plain dict of that op's dims
    (``MATMUL_DIMS`` / ``ATTENTION_DIMS`` below name them) and ``chip`` a key of ``CHIPS``;
  * a ``Prediction`` carries our kernel's predicted time and its BF16 baseline's predicted time
    (``ratio`` = baseline / ours: > 1 means FP8 wins), the bound that sets the time and the
    per-term breakdown, so a table can say why;
  * ``run_all`` (``__main__``) collects both halves' cases, predicts, prints ``table`` and writes
    ``experiments/results/perf_model.json`` + ``.md``.

All times are seconds. Nothing here needs a device or a compiler.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

# Names of the dims in ``Case.shape`` per op family (values: ints, or strings for dtypes).
#   matmul: M tokens, N out features, K in features, x "fp8"|"bf16" (activations given as)
#   grouped: + E groups (experts); M is the total rows over groups
#   attention: B batch, S context length, H q heads, KV kv heads, D head dim, cache "fp8"|"bf16"
MATMUL_DIMS = ("M", "N", "K", "x")
GROUPED_DIMS = ("M", "N", "K", "E", "x")
ATTENTION_DIMS = ("B", "S", "H", "KV", "D", "cache")


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak numbers of one accelerator (dense, per chip; sources in ``CHIPS``' comments)."""

    name: str  # key of CHIPS
    kind: str  # "gpu" | "tpu"
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float  # at the FP8 rate; v5e has no FP8 MXU: its bf16 rate after upcast
    cores: int  # SMs (GPU) or TensorCores (TPU)
    clock_hz: float  # the clock the datasheet peaks are computed at
    smem_bytes: int = 0  # GPU: opt-in shared memory per block; TPU: VMEM per core
    notes: str = ""


# H100 SXM5 / H200 SXM: NVIDIA H100 datasheet (989.4 TFLOP/s dense BF16, 1978.9 FP8, 3.35 TB/s;
# 1.83 GHz x 132 SMs x 4096 BF16 / 8192 FP8 FLOP per clock per SM), H200 datasheet (same
# compute, 4.8 TB/s HBM3e).
# v5e: 197 TFLOP/s bf16, 819 GB/s (cloud.google.com/tpu/docs/v5e). v6e: 918 TFLOP/s bf16,
# 1640 GB/s (cloud.google.com/tpu/docs/v6e); FP8 into the MXU at the bf16 rate.
CHIPS: dict[str, Chip] = {
    "h100": Chip("h100", "gpu", 3.35e12, 989.4e12, 1978.9e12, 132, 1.83e9, 232448, "H100 SXM5"),
    "h200": Chip("h200", "gpu", 4.8e12, 989.4e12, 1978.9e12, 132, 1.83e9, 232448, "H200 SXM"),
    "v5e": Chip("v5e", "tpu", 819e9, 197e12, 197e12, 1, 1.5e9, 128 << 20, "TPU v5e (v5 lite)"),
    "v6e": Chip("v6e", "tpu", 1640e9, 918e12, 918e12, 1, 1.75e9, 128 << 20, "TPU v6e (v6 lite)"),
}
GPU_CHIPS = ("h100", "h200")
TPU_CHIPS = ("v5e", "v6e")


@dataclasses.dataclass(frozen=True)
class Case:
    """One (op, shape) to predict; ``shape`` is a tuple of (dim, value) pairs (hashable)."""

    op: str
    label: str  # e.g. "Qwen3-8B q_proj M=4096 (prefill)"
    shape: tuple[tuple[str, int | str], ...]
    chips: tuple[str, ...]

    @property
    def dims(self) -> dict:
        return dict(self.shape)

    @staticmethod
    def make(op: str, label: str, chips, **dims) -> Case:
        return Case(op, label, tuple(sorted(dims.items())), tuple(chips))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Our kernel's predicted time beside its BF16 baseline's, and why."""

    op: str
    label: str
    chip: str
    impl: str  # our kernel variant, e.g. "pallas_mosaic_gpu qarray 128x128"
    time_s: float
    baseline: str  # e.g. "XLA BF16 jnp.dot (cuBLAS) at 70% of peak"
    baseline_s: float
    bound: str  # the term that sets time_s: "mma" | "issue" | "hbm" | "steps" | ...
    terms: dict = dataclasses.field(default_factory=dict)  # term -> seconds (or counts)
    bytes: int = 0  # HBM bytes our kernel must move (for % of bandwidth)
    flops: int = 0  # useful FLOPs
    notes: str = ""

    @property
    def ratio(self) -> float:
        """Speedup over the BF16 baseline (> 1: ours is faster)."""
        return self.baseline_s / self.time_s if self.time_s > 0 else math.inf

    def hbm_fraction(self) -> float:
        """Fraction of the chip's HBM bandwidth our kernel reaches (bytes / time / peak)."""
        return self.bytes / self.time_s / CHIPS[self.chip].hbm_bytes_per_s if self.time_s else 0.0

    def tflops(self) -> float:
        return self.flops / self.time_s / 1e12 if self.time_s else 0.0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ratio=self.ratio, hbm_fraction=self.hbm_fraction(), tflops=self.tflops())
        return d


def table(preds: list[Prediction]) -> str:
    """A markdown table: one row per prediction."""
    head = "| op | case | chip | impl | ours (us) | BF16 baseline (us) | ratio | bound | TFLOP/s |"
    head += " HBM % |"
    rows = [head, "|" + "---|" * 10]
    for p in preds:
        rows.append(
            f"| {p.op} | {p.label} | {p.chip} | {p.impl} | {p.time_s * 1e6:.1f} | "
            f"{p.baseline_s * 1e6:.1f} | {p.ratio:.2f}x | {p.bound} | {p.tflops():.0f} | "
            f"{100 * p.hbm_fraction():.0f} |"
        )
    return "\n".join(rows)


def write_results(preds: list[Prediction], path: str, extra: dict | None = None,
                  sections: dict | None = None) -> None:  # fmt: skip
    """``path`` (.json) and the same name with .md: the predictions, the table and ``sections``
    (title -> markdown text) after it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = dict(extra or {}, predictions=[p.to_json() for p in preds])
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    text = "# Performance model (predicted, no device)\n\n" + table(preds) + "\n"
    for title, body in (sections or {}).items():
        text += f"\n## {title}\n\n{body}\n"
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text)
