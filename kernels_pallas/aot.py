"""Deviceless ahead-of-time compilation for H100 (Mosaic GPU to SASS) and TPU v5e/v6e (libtpu).

Interpret mode proves a kernel's semantics; only a real compile proves it obeys the hardware's
rules (K-major 8-bit WGMMA operands, the 227 KiB shared-memory limit, legal FP8 conversions, TPU
block shapes, registers and spills). This module compiles a jitted function for a hardware target
on a CPU-only machine:

  * ``cuda``: needs ``jax-cuda12-plugin`` / ``jax-cuda12-pjrt`` of the installed jax version and
    ``nvidia-cuda-nvcc-cu12`` (ptxas); ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` lets the plugin
    register without a driver. The whole Mosaic GPU pipeline runs (kernels are compiled to SASS
    when XLA instantiates the custom call), and ptxas reports registers and spills per kernel.
  * ``tpu``: needs ``libtpu``; the full Mosaic TPU compiler runs for a ``v5e:1x1`` or ``v6e:1x1``
    topology.

``scripts/setup_aot.sh`` builds that toolchain in its own environment (never in ``.venv``);
``scripts/aot_check.py`` compiles every kernel and the rollout program at real shapes. Recipe:
jax#28376, openxla/xla#25919 (``runtime_version`` in the target config) and
``../shared/reference/kernels_wave2.md`` §6.3-6.4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import os
import re
import tempfile
from collections.abc import Callable

# The GpuTargetConfig of an H100 SXM (80 GB HBM3): what XLA and Mosaic GPU would query from the
# device. shared_memory_per_block_optin (232448 B = 227 KiB) is the Mosaic GPU SMEM budget.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 7
}
runtime_version {
  major: 12
  minor: 8
  patch: 0
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

H100_SMEM_BYTES = 232448
TARGETS = ("h100", "v5e", "v6e")
_TPU_TOPOLOGY = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}


def prepare_environment() -> None:
    """Environment variables the deviceless plugins need; call before jax initializes backends."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


@dataclasses.dataclass(frozen=True)
class AotCase:
    """One thing to compile ahead of time: ``fn(*args)`` for ``target`` at a named real shape.

    Kernel packages list theirs in ``<op>/aot_cases.py`` (``cases() -> list[AotCase]``);
    ``scripts/aot_check.py`` compiles them all and prints the table.
    """

    op: str  # e.g. "fp8_matmul"
    impl: str  # e.g. "pallas_mosaic_gpu"
    target: str  # one of TARGETS
    label: str  # the real shape, e.g. "Qwen3-8B q_proj M=16 (decode)"
    fn: Callable  # traced with jax.jit
    args: tuple  # ShapeDtypeStructs (pytrees allowed)


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """ptxas resource report of one Mosaic GPU kernel."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    smem_bytes: int  # static SMEM ptxas reports (Mosaic GPU allocates dynamic SMEM: see below)


@dataclasses.dataclass
class CompileResult:
    """A compiled executable and what the compile reported."""

    target: str
    compiled: object  # jax.stages.Compiled
    kernels: list[KernelReport]  # Mosaic GPU kernels (empty for TPU and XLA-only programs)

    @property
    def max_registers(self) -> int:
        return max((k.registers for k in self.kernels), default=0)

    @property
    def spills(self) -> int:
        return sum(k.spill_stores + k.spill_loads for k in self.kernels)


@functools.cache
def _topology(target: str):
    from jax.experimental import topologies

    if target == "h100":
        return topologies.get_topology_desc(
            platform="cuda", topology_name="", topology="1x1x1", target_config=H100_TARGET_CONFIG
        )
    if target in _TPU_TOPOLOGY:
        return topologies.get_topology_desc(platform="tpu", topology_name=_TPU_TOPOLOGY[target])
    raise ValueError(f"aot: unknown target {target!r}; expected one of {TARGETS}")


def target_mesh(target: str):
    """A one-device ``Mesh`` over the target's deviceless topology."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(_topology(target).devices[:1]), ("x",))


def abstract_args(target: str, *args):
    """Replaces arrays / ShapeDtypeStructs in ``args`` by replicated ShapeDtypeStructs on target."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sh = NamedSharding(target_mesh(target), P())

    def one(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        return x

    return jax.tree.map(one, args)


_PTXAS_RE = re.compile(
    r"Function properties for (?P<name>\S+).*?(?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads.*?Used (?P<regs>\d+) registers"
    r"(?:.*?(?P<smem>\d+) bytes smem)?",
    re.S,
)


def parse_ptxas(text: str) -> list[KernelReport]:
    """Kernel reports from ptxas ``-v`` output (one entry per compiled function)."""
    return [
        KernelReport(
            m["name"], int(m["regs"]), int(m["stores"]), int(m["loads"]), int(m["smem"] or 0)
        )
        for m in _PTXAS_RE.finditer(text)
    ]


@contextlib.contextmanager
def _mosaic_gpu_dump():
    """Points Mosaic GPU's dumps (PTX, ptxas report) at a fresh directory for one compile."""
    keys = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_PTX")
    old = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="mosaic_gpu_dump_") as d:
        os.environ.update(MOSAIC_GPU_DUMP_TO=d, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
        reports: list[KernelReport] = []
        try:
            yield reports
            for path in sorted(glob.glob(os.path.join(d, "*.ptxas"))):
                with open(path) as f:
                    reports.extend(parse_ptxas(f.read()))
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def compile_for(target: str, fn: Callable, *args, static_argnames=(), **kwargs) -> CompileResult:
    """``jax.jit(fn).lower(*args).compile()`` for ``target`` ("h100", "v5e", "v6e"), no device.

    ``args`` are arrays or ShapeDtypeStructs (pytrees allowed); they are replaced by replicated
    ShapeDtypeStructs on the target. Raises what the compiler raises (SMEM over budget, illegal
    layouts or conversions, TPU block-shape rules).
    """
    import jax

    mesh = target_mesh(target)
    abstract = abstract_args(target, *args)
    jitted = jax.jit(fn, static_argnames=static_argnames)
    dump = _mosaic_gpu_dump() if target == "h100" else contextlib.nullcontext([])
    with dump as reports, jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jitted.lower(*abstract, **kwargs).compile()
    return CompileResult(target, compiled, reports)
