"""Shared pieces of the benchmark scripts: run metadata, hardware peaks, timing, JSON + markdown.

Timing (``../shared/reference/performance_anchors.md`` §3): a program is compiled ahead of the
clock (``compile_fn``: ``jit(f).lower(*args).compile()``, compile time recorded apart), run twice
to warm up, then timed ``runs`` times. Two timers: the wall clock of each call
(``block_until_ready``), and on GPU the device time of the call's kernels from CUPTI
(``jax.experimental.mosaic.gpu.profiler.measure``), which leaves out host dispatch and launch
gaps. A call may run the op ``reps`` times over distinct operand sets (``rotations``): the sets
together exceed the L2 cache several times, so every op reads its operands from HBM, and the
per-call dispatch cost is spread over ``reps`` ops. Reported per op: the median, p20 and p80.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"

# Dense datasheet peaks (performance_anchors.md §1a): device-kind pattern -> (HBM bytes/s,
# BF16 FLOP/s, FP8 FLOP/s). First match wins, so the PCIe/NVL parts come before "H100".
PEAKS = (
    (r"H100 PCIe", (2.0e12, 756e12, 1513e12)),
    (r"H100 NVL", (3.9e12, 835e12, 1671e12)),
    (r"H200", (4.8e12, 989e12, 1979e12)),
    (r"GH200", (4.0e12, 989e12, 1979e12)),
    (r"H100|H800", (3.35e12, 989e12, 1979e12)),
)
L2_ROTATE_BYTES = (
    512 * 2**20
)  # operand bytes one timed call cycles through (H100/H200 L2: 50-60 MB)
MAX_REPS = 16


@dataclasses.dataclass(frozen=True)
class Peaks:
    hbm_bytes_s: float | None
    bf16_flops: float | None
    fp8_flops: float | None


def peaks(device_kind: str) -> Peaks:
    """Datasheet peaks of a device kind (None where the kind is not in ``PEAKS``)."""
    for pattern, vals in PEAKS:
        if re.search(pattern, device_kind):
            return Peaks(*vals)
    return Peaks(None, None, None)


def git_sha() -> str:
    """``$GIT_SHA`` if set (a copied tree without .git), else ``git rev-parse HEAD`` (+dirty)."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        run = lambda *a: subprocess.check_output(["git", *a], cwd=ROOT, text=True, timeout=10)
        sha = run("rev-parse", "HEAD").strip()
        return sha + ("-dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout; set GIT_SHA)"


def source_hash() -> str:
    """sha256 over the repo's Python and shell sources: identifies a tree copied without .git."""
    h = hashlib.sha256()
    for top in ("fp8rl_jax", "kernels_pallas", "experiments", "scripts", "tests"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix in (".py", ".sh") and p.is_file():
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def env_meta() -> dict:
    """What a result depends on: code version, jax/jaxlib, device, platform version."""
    import jaxlib

    dev = jax.devices()[0]
    return dict(
        git_sha=git_sha(),
        source_hash=source_hash(),
        jax=jax.__version__,
        jaxlib=getattr(jaxlib, "__version__", "unknown"),
        python=platform.python_version(),
        platform=dev.platform,
        device_kind=dev.device_kind,
        n_devices=jax.device_count(),
        compute_capability=str(getattr(dev, "compute_capability", "")) or None,
        platform_version=getattr(getattr(dev, "client", None), "platform_version", None),
        compilation_cache=os.environ.get("JAX_COMPILATION_CACHE_DIR"),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def rotations(set_bytes: int, platform_name: str) -> int:
    """Operand sets per timed call: enough to cycle ``L2_ROTATE_BYTES`` through the GPU (one
    elsewhere, where there is no such cache to defeat and dispatch is not the issue)."""
    if platform_name != "gpu":
        return 1
    return int(min(MAX_REPS, max(1, math.ceil(L2_ROTATE_BYTES / max(set_bytes, 1)))))


def compile_fn(fn, *args):
    """(compiled, seconds): ``jit(fn)`` compiled for ``args`` ahead of any timing."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _cupti_seconds(compiled, args, runs: int) -> np.ndarray:
    """Device time of each of ``runs`` calls: the sum of its kernels' CUPTI durations."""
    from jax.experimental.mosaic.gpu import profiler

    _, ms = profiler.measure(compiled, aggregate=True, iterations=runs)(*args)
    if ms is None:
        raise RuntimeError("CUPTI recorded no kernels")
    return np.atleast_1d(np.asarray(ms, np.float64)) * 1e-3


@dataclasses.dataclass
class Timing:
    """Per-op times (seconds) of one timed program, and how they were taken."""

    wall_s: np.ndarray  # wall clock per call / reps
    kernel_s: np.ndarray | None  # CUPTI device time per call / reps (GPU), else None
    reps: int  # ops per call
    compile_s: float
    note: str = ""  # why there is no kernel time, if there is none

    @property
    def best(self) -> np.ndarray:
        """The device time where there is one, else the wall clock."""
        return self.wall_s if self.kernel_s is None else self.kernel_s

    @property
    def timer(self) -> str:
        return "wall" if self.kernel_s is None else "cupti"

    def summary(self, prefix: str = "") -> dict:
        t = self.best
        out = {
            f"{prefix}median_us": float(np.median(t)) * 1e6,
            f"{prefix}p20_us": float(np.percentile(t, 20)) * 1e6,
            f"{prefix}p80_us": float(np.percentile(t, 80)) * 1e6,
            f"{prefix}wall_median_us": float(np.median(self.wall_s)) * 1e6,
            f"{prefix}timer": self.timer,
        }
        if self.note:
            out[f"{prefix}timer_note"] = self.note
        return out | {"reps_per_call": self.reps, "compile_s": self.compile_s}


def time_compiled(compiled, args, *, runs: int, reps: int = 1, compile_s: float = 0.0,
                  warmup: int = 2) -> Timing:  # fmt: skip
    """Times ``compiled(*args)`` (which runs the op ``reps`` times): wall clock and, on GPU,
    CUPTI kernel time; both per op."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    wall = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        wall.append(time.perf_counter() - t0)
    kernel, note = None, ""
    if jax.devices()[0].platform == "gpu":
        try:
            kernel = _cupti_seconds(compiled, args, runs) / reps
        except Exception as e:  # noqa: BLE001 - no CUPTI here: fall back to the wall clock
            note = f"CUPTI unavailable ({type(e).__name__}: {str(e)[:200]})"
    return Timing(np.asarray(wall) / reps, kernel, reps, compile_s, note)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats get 3 significant digits, None becomes '-'."""

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e5 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def default_out(name: str) -> pathlib.Path:
    """``experiments/results/<name>_<device>.json`` (device: cpu, or the GPU kind)."""
    dev = jax.devices()[0]
    kind = "cpu" if dev.platform == "cpu" else re.sub(r"[^a-z0-9]+", "_", dev.device_kind.lower())
    return RESULTS / f"{name}_{kind.strip('_')}.json"


def write_results(path, meta: dict, rows: list[dict], markdown: str) -> pathlib.Path:
    """Writes ``{meta, rows}`` to ``path`` (JSON) and ``markdown`` beside it (``.md``);
    atomic per file, so a run killed mid-way leaves the last complete write."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for p, text in ((path, json.dumps(dict(meta=meta, rows=rows), indent=1)),
                    (path.with_suffix(".md"), markdown)):  # fmt: skip
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(p)
    return path
