"""Implementation tables: which kernel runs an op, decided by a support check that cannot crash.

Each op (``fp8_matmul``, ``decode_attention``, ...) has an ``ImplTable``: its implementations, each
with a pure-Python ``supports(*args, **kw)`` that returns ``None`` when the kernel compiles for
those operands on the target device, or the reason it does not (shapes, dtypes, block sizes).
``impl="auto"`` takes the target's kernel (``default_impl``: Mosaic GPU on Hopper, Mosaic TPU on
TPU) when its check passes, else the XLA implementation (one log line per reason); an explicitly
requested kernel whose check fails raises a ``ValueError`` with the reason (explicit requests run
anywhere, e.g. in interpret mode on CPU).

The target device is the abstract mesh's device when one is set (deviceless ahead-of-time
compilation, ``kernels_pallas/aot.py``), else ``jax.devices()[0]``. (tokamax ``ops/op.py`` uses
the same pattern of per-implementation support checks.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from typing import Any, Literal

import jax

log = logging.getLogger(__name__)

Impl = Literal["auto", "xla", "pallas_mosaic_gpu", "pallas_tpu"]
IMPLS = ("auto", "xla", "pallas_mosaic_gpu", "pallas_tpu")

# Hopper (sm_90) device kinds, for abstract devices that carry no compute capability.
_HOPPER_KIND = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a program is being compiled for."""

    platform: str  # "cpu" | "gpu" | "tpu"
    device_kind: str  # e.g. "NVIDIA H100 80GB HBM3", "TPU v6 lite", "cpu"
    compute_capability: str | None = None  # GPUs with a real device only, e.g. "9.0"

    @property
    def is_hopper(self) -> bool:
        if self.platform != "gpu":
            return False
        if self.compute_capability is not None:
            return self.compute_capability.startswith("9.")
        return bool(_HOPPER_KIND.search(self.device_kind))


def target_device() -> Target:
    """The abstract mesh's device under ahead-of-time compilation, else the first local device."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    real = jax.devices()[0]
    if dev is None:
        dev = real
    cc = getattr(real, "compute_capability", None) if real.device_kind == dev.device_kind else None
    return Target(dev.platform, dev.device_kind, None if cc is None else str(cc))


def device_reason(kind: str, interpret: bool) -> str | None:
    """Why a kernel for ``kind`` ("gpu": Mosaic GPU, Hopper only; "tpu": Mosaic TPU) cannot run
    on the target, or None (interpret mode runs anywhere): the device half of a support check."""
    if interpret:
        return None
    t = target_device()
    if kind == "gpu" and not t.is_hopper:
        return f"needs a Hopper GPU (sm_90), the target is {t.device_kind!r}"
    if kind == "tpu" and t.platform != "tpu":
        return f"needs a TPU, the target is {t.device_kind!r}"
    return None


# Mosaic GPU interpret mode runs each emulated warpgroup (and each CTA of a cluster) as its own
# jitted program on its own Python thread, their barriers as host callbacks that block until the
# other threads arrive. XLA:CPU's concurrency-optimized thunk schedule runs such callbacks on its
# intra-op pool (one thread per core): once every pool thread blocks in a barrier, the programs
# that would release them wait for a pool thread, and the process hangs (test_cluster_k's
# 3-chunk f32 case hung on every run pinned to one core, and once in the suite on 2 cores). With
# this scheduler off, the callbacks run on their program's own thread: the same runs pass.
GPU_INTERPRET_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def prepare_gpu_interpret() -> bool:
    """Add ``GPU_INTERPRET_XLA_FLAG`` to ``XLA_FLAGS`` (unless the user set that flag), so that
    Mosaic GPU kernels interpreted on CPU cannot hang. XLA reads ``XLA_FLAGS`` once, when a
    process's first computation creates its backend: call this before that (tests: conftest.py;
    scripts: after parsing their arguments). True if the flag is (now) in effect; False, with a
    warning, when a backend already exists without it."""
    from jax._src import xla_bridge  # private: the one place that knows whether a backend exists

    name = GPU_INTERPRET_XLA_FLAG.split("=")[0]
    flags = os.environ.get("XLA_FLAGS", "")
    if name in flags:
        return True
    if xla_bridge.backends_are_initialized():
        log.warning(
            "Mosaic GPU interpret mode may hang: jax's backend started without %s "
            "(set it in XLA_FLAGS before the first computation)",
            GPU_INTERPRET_XLA_FLAG,
        )
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {GPU_INTERPRET_XLA_FLAG}".strip()
    return True


def default_impl() -> str:
    """The kernel ``auto`` prefers on this target, before support checks: Mosaic GPU on Hopper,
    Mosaic TPU on TPU, the XLA implementation elsewhere."""
    t = target_device()
    if t.is_hopper:
        return "pallas_mosaic_gpu"
    if t.platform == "tpu":
        return "pallas_tpu"
    return "xla"


Supports = Callable[..., str | None]


def _always(*_, **__) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run an op: ``run(*args, config=, interpret=, **kw)`` if ``supports`` allows."""

    name: str  # one of IMPLS (not "auto")
    run: Callable[..., Any]
    supports: Supports = _always  # None: compiles for these operands on the target; else why not


_logged: set[tuple[str, str, str]] = set()


class ImplTable:
    """An op's implementations, with ``select`` deciding which one runs (see the module doc)."""

    def __init__(self, op: str, impls: list[Implementation], fallback: str = "xla"):
        self.op = op
        self.impls = {i.name: i for i in impls}
        if fallback not in self.impls:
            raise ValueError(f"{op}: the fallback {fallback!r} must be one of the implementations")
        self.fallback = fallback

    @property
    def names(self) -> tuple[str, ...]:
        return ("auto", *self.impls)

    def select(self, impl: str, *args, interpret: bool = False, **kw) -> Implementation:
        """The implementation that runs ``args``: see the module docstring for ``auto``."""
        if impl != "auto":
            if impl not in self.impls:
                raise ValueError(f"{self.op}: unknown impl {impl!r}; expected one of {self.names}")
            chosen = self.impls[impl]
            reason = chosen.supports(*args, interpret=interpret, **kw)
            if reason is not None:
                raise ValueError(f"{self.op}: impl {impl!r} cannot run these operands: {reason}")
            return chosen
        cand = self.impls.get(default_impl())
        if cand is None or cand.name == self.fallback:
            return self.impls[self.fallback]
        reason = cand.supports(*args, interpret=interpret, **kw)
        if reason is None:
            return cand
        key = (self.op, cand.name, reason)
        if key not in _logged:
            _logged.add(key)
            log.warning("%s: %s not used (%s); falling back to %s", *key, self.fallback)
        return self.impls[self.fallback]


@dataclasses.dataclass(frozen=True)
class KernelImpls:
    """Which implementation each kernel op uses inside a program: a static (hashable) argument of
    the model forward and the rollout, so changing it recompiles instead of reusing a program."""

    matmul: Impl = "auto"  # fp8_matmul: the W8A8 linear layers of a quantized policy
    decode_attention: Impl | None = None  # one-token decode steps; None: the model's jnp attention
    grouped_matmul: Impl = "auto"  # grouped_fp8_matmul: the FP8 MoE experts of a quantized policy
    expert_matmul: Impl = "auto"  # grouped_matmul: the BF16 MoE experts (training, scoring)
    interpret: bool = False  # decode_attention / expert_matmul kernels interpreted (CPU tests)

    def __post_init__(self):
        for name in ("matmul", "grouped_matmul"):
            if getattr(self, name) not in IMPLS:
                raise ValueError(
                    f"KernelImpls.{name} must be one of {IMPLS}, got {getattr(self, name)!r}"
                )
        if self.decode_attention is not None and self.decode_attention not in IMPLS:
            raise ValueError(
                f"KernelImpls.decode_attention must be None or one of {IMPLS}, "
                f"got {self.decode_attention!r}"
            )


DEFAULT_KERNELS = KernelImpls()
