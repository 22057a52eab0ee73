"""Deviceless ahead-of-time compilation for H100 (Mosaic GPU to SASS) and TPU v5e/v6e (libtpu).

Interpret mode proves a kernel's semantics; only a real compile proves it obeys the hardware's
rules (K-major 8-bit WGMMA operands, the 227 KiB shared-memory limit, legal FP8 conversions, TPU
block shapes, registers and spills). This module compiles a jitted function for a hardware target
on a CPU-only machine:

  * ``cuda``: needs ``jax-cuda12-plugin`` / ``jax-cuda12-pjrt`` of the installed jax version and
    ``nvidia-cuda-nvcc-cu12`` (ptxas), or their CUDA 13 versions (``jax-cuda13-*``,
    ``nvidia-cuda-nvcc``); ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` lets the plugin
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
import sys
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
PLATFORM = {"h100": "cuda", "v5e": "tpu", "v6e": "tpu"}
_TPU_TOPOLOGY = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}
# What jax.devices() would report on each target; Pallas reads it from the abstract mesh when
# lowering without a device (tpu_info for TPU generations, the SM count for Mosaic GPU).
_DEVICE_KIND = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, "gpu"),
    "v5e": ("TPU v5 lite", 1, "tpu"),
    "v6e": ("TPU v6 lite", 1, "tpu"),
}
# The custom call each Pallas backend leaves in the compiled HLO / exported StableHLO.
_TRITON_TARGET = "__gpu$xla.gpu.triton"
_KERNEL_MARKERS = {"cuda": ("mosaic_gpu", re.escape(_TRITON_TARGET)), "tpu": ("tpu_custom_call",)}

STATUSES = ("ok", "fail", "smem", "spill", "no-kernel", "no-report", "crash", "timeout")


def prepare_environment() -> None:
    """Environment variables the deviceless plugins need; call before jax initializes backends.

    Meant for AOT processes (``aot_check.py``, ``bench_bytes.py``): it restricts jax to the CPU
    backend (the CUDA and TPU topologies come from their plugins without a device).
    """
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    # Only the CPU backend initializes; the CUDA and TPU topologies come from their plugins.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Several AOT processes (aot_check's workers, other users) may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # No device to autotune on: XLA's GEMM fusions take their default configs (and compile faster).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_autotune_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()
    if "jax" in sys.modules:  # jax read JAX_PLATFORMS at import; its backends start later
        sys.modules["jax"].config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


@dataclasses.dataclass(frozen=True)
class AotCase:
    """One thing to compile ahead of time: ``fn(*args)`` for ``target`` at a named real shape.

    Kernel packages list theirs in ``<op>/aot_cases.py`` (``cases() -> list[AotCase]``);
    ``scripts/aot_check.py`` compiles them all and prints the table. A ``pallas_*`` impl must
    leave at least one Pallas kernel in the compiled program (a silent fallback fails the case).
    """

    op: str  # e.g. "fp8_matmul"
    impl: str  # e.g. "pallas_mosaic_gpu"
    target: str  # one of TARGETS
    label: str  # the real shape, e.g. "Qwen3-8B q_proj M=16 (decode)"
    fn: Callable  # traced with jax.jit
    args: tuple  # ShapeDtypeStructs (pytrees allowed)

    @property
    def key(self) -> str:
        return f"{self.op} | {self.impl} | {self.target} | {self.label}"

    @property
    def expects_kernel(self) -> bool:
        return self.impl.startswith("pallas")


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """Resources of one GPU kernel: ptxas for Mosaic GPU (plus its dynamic SMEM when dumped),
    cuobjdump for Pallas Triton."""

    name: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    static_smem_bytes: int = 0  # what ptxas reports (Mosaic GPU allocates SMEM dynamically)
    dynamic_smem_bytes: int = 0  # Mosaic GPU's scratch (``*.resources.txt`` dump), 0 if absent

    @property
    def smem_bytes(self) -> int:
        return self.static_smem_bytes + self.dynamic_smem_bytes


@dataclasses.dataclass
class CompileResult:
    """A compiled executable (or, for the quick tier, an export) and what the compile reported."""

    target: str
    compiled: object  # jax.stages.Compiled, or jax.export.Exported for the quick tier
    kernels: list[KernelReport]  # Mosaic GPU ptxas + Pallas Triton cuobjdump reports (H100 only)
    num_pallas_kernels: int = 0  # Pallas custom calls in the compiled HLO / exported module

    @property
    def max_registers(self) -> int:
        return max((k.registers for k in self.kernels), default=0)

    @property
    def spills(self) -> int:
        """Spilled bytes (stores + loads) over all kernels."""
        return sum(k.spill_stores + k.spill_loads for k in self.kernels)

    @property
    def max_smem_bytes(self) -> int:
        return max((k.smem_bytes for k in self.kernels), default=0)


@functools.cache
def _topology(target: str):
    from jax.experimental import topologies

    if target == "h100":
        return topologies.get_topology_desc(
            platform="cuda", topology_name="", topology="1x1x1", target_config=H100_TARGET_CONFIG
        )
    if target in _TPU_TOPOLOGY:
        # One chip per host: libtpu 0.0.48 (jax 0.11.2) defaults to 2x2x1, which 1x1 cannot fill.
        return topologies.get_topology_desc(
            platform="tpu", topology_name=_TPU_TOPOLOGY[target], chips_per_host_bounds=[1, 1, 1]
        )
    raise ValueError(f"aot: unknown target {target!r}; expected one of {TARGETS}")


def target_mesh(target: str):
    """A one-device ``Mesh`` over the target's deviceless topology."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(_topology(target).devices[:1]), ("x",))


def abstract_mesh(target: str):
    """A one-device ``AbstractMesh`` that names the target's device kind (no plugin needed)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    if target not in _DEVICE_KIND:
        raise ValueError(f"aot: unknown target {target!r}; expected one of {TARGETS}")
    kind, cores, platform = _DEVICE_KIND[target]
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    return AbstractMesh((1,), ("x",), abstract_device=device)


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
    r"(?:[^\n]*?(?P<smem>\d+) bytes smem)?",
    re.S,
)
_SCRATCH_RE = re.compile(r"smem_scratch_bytes=(\d+)")


def parse_ptxas(text: str, dynamic_smem_bytes: int = 0) -> list[KernelReport]:
    """Kernel reports from ptxas ``-v`` output (one entry per compiled function)."""
    return [
        KernelReport(
            m["name"],
            int(m["regs"]),
            int(m["stores"]),
            int(m["loads"]),
            int(m["smem"] or 0),
            dynamic_smem_bytes,
        )  # fmt: skip
        for m in _PTXAS_RE.finditer(text)
    ]


def parse_resources(text: str) -> int:
    """Mosaic GPU's dynamic SMEM (``smem_scratch_bytes``) from a ``*.resources.txt`` dump, or 0."""
    m = _SCRATCH_RE.search(text)
    return int(m.group(1)) if m else 0


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _suffix(path: str) -> int:
    """The dump counter of ``<name>_<n>.<ext>`` (Mosaic GPU numbers each dump kind itself)."""
    m = re.search(r"_(\d+)\.[a-z.]+$", os.path.basename(path))
    return int(m.group(1)) if m else -1


def _kernel_key(path: str) -> str:
    """Identity of a lowered kernel: its Mosaic module before layout inference, names removed."""
    return re.sub(r"\b\w+_\d+\b", "_", _read(path))


# Process-wide: kernel key -> its ptxas report. Mosaic GPU compiles a module it has compiled
# before from its in-process cache, so a second case with an identical kernel (e.g. fp8_matmul
# M=1 and M=16, both one 16-row swap-AB tile) produces the MLIR dumps but no PTX / ptxas.
_REPORTS: dict[str, KernelReport] = {}


def read_dumps(directory: str) -> list[KernelReport]:
    """Kernel reports of one compile's Mosaic GPU dump directory, one per lowered kernel.

    Mosaic GPU numbers its MLIR-level dumps (``<k>_<i>.resources.txt``, written for every kernel
    lowered) and its PTX-level dumps (``<k>_<j>.ptxas``, only for kernels actually compiled) with
    separate counters, so names do not pair them. Order does: the kernels compiled are, in order,
    the lowered kernels not compiled before in this process. Each ptxas report gets the dynamic
    SMEM of its lowered kernel; a kernel from the cache gets the report of its first compile.
    If the counts disagree (a dump is missing), each ptxas report gets the largest dynamic SMEM
    of the directory (conservative for the budget check).
    """
    ptxas = sorted(glob.glob(os.path.join(directory, "*.ptxas")), key=_suffix)
    compiled = [r for p in ptxas for r in parse_ptxas(_read(p))]
    lowered = []  # (key, dynamic smem) per lowered kernel, in lowering order
    for res in sorted(glob.glob(os.path.join(directory, "*.resources.txt")), key=_suffix):
        mlir = res[: -len(".resources.txt")] + ".before_layout_inference.txt"
        key = _kernel_key(mlir) if os.path.exists(mlir) else res
        lowered.append((key, parse_resources(_read(res))))
    new, seen = [], set(_REPORTS)
    for key, scratch in lowered:
        if key not in seen:
            new.append((key, scratch))
            seen.add(key)
    if len(new) != len(compiled):
        top = max((s for _, s in lowered), default=0)
        return [dataclasses.replace(r, dynamic_smem_bytes=top) for r in compiled]
    for (key, scratch), r in zip(new, compiled, strict=True):
        _REPORTS[key] = dataclasses.replace(r, dynamic_smem_bytes=scratch)
    return [_REPORTS[key] for key, _ in lowered]


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
            reports.extend(read_dumps(d))
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_RES_RE = re.compile(
    r"Function (?P<name>\S+):\s*REG:(?P<regs>\d+) STACK:(?P<stack>\d+) "
    r"SHARED:(?P<smem>\d+) LOCAL:(?P<local>\d+)"
)


def triton_reports(cache_file: str) -> list[KernelReport]:
    """Registers, local memory and static SMEM of the Pallas Triton kernels (named ``*_triton``)
    XLA compiled into its kernel cache (``xla_gpu_kernel_cache_file``: the cubins), read by
    ``cuobjdump -res-usage``. A spill is local memory: its bytes are reported as spill stores.
    Empty when the cache or cuobjdump (``scripts/setup_aot.sh``) is missing."""
    import subprocess

    from kernels_pallas.perf_model.sass import tool

    cuobjdump = tool("cuobjdump")
    if cuobjdump is None or not os.path.exists(cache_file):
        return []
    with open(cache_file, "rb") as f:
        blob = f.read()
    starts = [m.start() for m in re.finditer(rb"\x7fELF", blob)] + [len(blob)]
    out = []
    with tempfile.TemporaryDirectory(prefix="xla_kernels_") as d:
        for i, (lo, hi) in enumerate(zip(starts, starts[1:])):
            path = os.path.join(d, f"{i}.cubin")  # trailing cache bytes: cuobjdump ignores them
            with open(path, "wb") as f:
                f.write(blob[lo:hi])
            res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True)
            for m in _RES_RE.finditer(res.stdout):
                if m["name"].endswith("_triton"):
                    local = int(m["local"]) + int(m["stack"])
                    out.append(KernelReport(m["name"], int(m["regs"]), local, 0, int(m["smem"])))
    return out


def count_kernels(text: str, target: str) -> int:
    """Pallas kernels (Mosaic GPU / Mosaic TPU / Pallas Triton custom calls) in HLO or
    StableHLO text."""
    markers = _KERNEL_MARKERS[PLATFORM[target]]
    pat = re.compile(r"custom_call_target\s*=\s*\"(" + "|".join(markers) + r")[^\"]*\"")
    pat_mlir = re.compile(r"stablehlo\.custom_call\s+@(" + "|".join(markers) + r")\w*")
    return len(pat.findall(text)) + len(pat_mlir.findall(text))


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
    with (
        dump as reports,
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
        tempfile.TemporaryDirectory(prefix="xla_kernel_cache_") as d,
    ):
        lowered = jitted.lower(*abstract, **kwargs)
        cache = os.path.join(d, "kernels.bin")
        if target == "h100":  # the cubins, for the Pallas Triton kernels' resources
            compiled = lowered.compile(compiler_options={"xla_gpu_kernel_cache_file": cache})
        else:
            compiled = lowered.compile()
        triton = triton_reports(cache) if target == "h100" else []
    n = count_kernels(compiled.as_text(), target)
    return CompileResult(target, compiled, [*reports, *triton], n)


def export_for(target: str, fn: Callable, *args) -> CompileResult:
    """Quick tier: ``jax.export`` lowering for the target's platform ("cuda" or "tpu").

    Runs Pallas to Mosaic MLIR and, for Mosaic GPU, the Python passes (layout inference, the SMEM
    budget); not ptxas or the Mosaic TPU compiler, so no registers or spills. No plugin needed.
    """
    import jax

    def sds(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x

    abstract = jax.tree.map(sds, args)
    with jax.sharding.use_abstract_mesh(abstract_mesh(target)):
        exported = jax.export.export(
            jax.jit(fn),
            platforms=[PLATFORM[target]],
            # Pallas Triton kernels (``act_quantize``) have no export compatibility guarantee;
            # this tier only lowers them, it never serializes them for another jax
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)],
        )(*abstract)
    n = count_kernels(exported.mlir_module(), target)
    return CompileResult(target, exported, [], n)


def one_line(exc: BaseException, limit: int = 400) -> str:
    """The compiler's reason in one line: the first informative line of the message."""
    text = re.sub(r"/\S*/(\w+/\w+\.py)", r"\1", str(exc).strip()) or type(exc).__name__
    lines = [" ".join(ln.split()) for ln in text.splitlines() if ln.strip()]
    generic = ("traceback", "---", "for simplicity", "the above exception")
    line = next((ln for ln in lines if not ln.lower().startswith(generic)), lines[0])
    line = f"{type(exc).__name__}: {line}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def status_of(case: AotCase, result: CompileResult | None, exc: BaseException | None) -> str:
    """ok | fail (compile error) | smem (over the SMEM budget) | spill | no-kernel | no-report."""
    if exc is not None:
        return "smem" if "shared memory" in str(exc) else "fail"
    if case.expects_kernel and result.num_pallas_kernels == 0:
        return "no-kernel"
    compiled = hasattr(result.compiled, "as_text")  # not the quick tier's export
    if compiled and case.target == "h100" and result.num_pallas_kernels and not result.kernels:
        return "no-report"  # Mosaic GPU kernels whose registers and spills nobody has seen
    if result.spills or result.max_smem_bytes > H100_SMEM_BYTES:
        return "spill" if result.spills else "smem"
    return "ok"
