"""Deviceless hardware targets of the planner: ``8xh100``, ``32xh100``, ``v6e-8``, ``v5e-32``, ...

A ``Topology`` names a chip kind, a chip count, the hosts they sit on and the HBM of one chip;
``devices`` returns jax compile-only devices for it (the CUDA plugin's topology for H100/H200,
libtpu's for TPU, the local CPU devices for ``cpu-N``), so a program can be lowered and compiled
for the target on a machine without one (``kernels_pallas/aot.py`` for the toolchain).
"""

from __future__ import annotations

import dataclasses
import math
import re

from kernels_pallas.aot import H100_TARGET_CONFIG

GIB = 2**30
# HBM per chip: what the device reports (H100 SXM 80 GB: 81,559 MiB; H200: 143,771 MiB), TPU
# per-chip HBM (v5e 16 GiB, v6e 32 GiB, v5p 95 GiB); cpu-N is the test target.
HBM_BYTES = {
    "h100": 84_929_347_584,
    "h200": 143_771 * 2**20,
    "v5e": 16 * GIB,
    "v6e": 32 * GIB,
    "v5p": 95 * GIB,
    "cpu": 16 * GIB,
}
GPU_PER_HOST = 8  # HGX nodes
TPU_PER_HOST = {"v5e": 4, "v6e": 4, "v5p": 4}  # chips per TPU VM host
# 2D (v5e, v6e) and 3D (v5p) slice shapes by chip count.
_TPU_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TPU_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
FORMS = "<N>xh100 | <N>xh200 | v5e-<N> | v6e-<N> | v5p-<N> (N TensorCores) | cpu-<N>"


@dataclasses.dataclass(frozen=True)
class Topology:
    """A hardware target: ``chips`` devices of one ``kind`` over ``hosts`` hosts."""

    name: str  # as given, e.g. "32xh100"
    kind: str  # h100 | h200 | v5e | v6e | v5p | cpu
    chips: int  # devices of the mesh (a TPU chip is one device, v5p megacore included)
    hosts: int  # hosts (processes) they are spread over

    @property
    def hbm_bytes(self) -> int:
        return HBM_BYTES[self.kind]

    @property
    def platform(self) -> str:
        return {"h100": "cuda", "h200": "cuda", "cpu": "cpu"}.get(self.kind, "tpu")

    @property
    def shape(self) -> str:
        """The plugin's topology string: CUDA ``slices x hosts x gpus``, TPU slice shape."""
        if self.platform == "cuda":
            return f"1x{self.hosts}x{self.chips // self.hosts}"
        table = _TPU_3D if self.kind == "v5p" else _TPU_2D
        return table[self.chips]


def parse_topology(name: str) -> Topology:
    """``Topology`` of a name like ``8xh100``, ``32xh100``, ``v6e-8``, ``v5p-8``, ``cpu-4``."""
    text = name.strip().lower()
    if m := re.fullmatch(r"(\d+)x(h100|h200)", text):
        n, kind = int(m[1]), m[2]
        if n > GPU_PER_HOST and n % GPU_PER_HOST:
            raise ValueError(f"topology {name!r}: {n} GPUs are not whole {GPU_PER_HOST}-GPU hosts")
        return Topology(name, kind, n, max(1, n // GPU_PER_HOST))
    if m := re.fullmatch(r"(v5e|v6e|v5p)-(\d+)", text):
        kind, n = m[1], int(m[2])
        chips = n // 2 if kind == "v5p" else n  # v5p-N counts TensorCores, 2 per chip
        table = _TPU_3D if kind == "v5p" else _TPU_2D
        if chips not in table:
            raise ValueError(f"topology {name!r}: no {kind} slice of {chips} chips in {table}")
        return Topology(name, kind, chips, max(1, chips // TPU_PER_HOST[kind]))
    if m := re.fullmatch(r"cpu-(\d+)", text):
        return Topology(name, "cpu", int(m[1]), 1)
    raise ValueError(f"unknown topology {name!r}; expected {FORMS}")


def _gpu_target_config(kind: str) -> str:
    if kind == "h100":
        return H100_TARGET_CONFIG
    mem = f"device_memory_size: {HBM_BYTES['h200']}"
    text = re.sub(r"device_memory_size: \d+", mem, H100_TARGET_CONFIG)
    text = text.replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
    return text.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def devices(topo: Topology) -> list:
    """Compile-only devices of ``topo`` (``cpu``: this process's CPU devices, which must be
    at least ``chips``: ``--xla_force_host_platform_device_count``)."""
    import jax
    from jax.experimental import topologies

    if topo.platform == "cpu":
        devs = jax.devices("cpu")
        if len(devs) < topo.chips:
            raise ValueError(
                f"topology {topo.name}: {len(devs)} CPU devices; set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={topo.chips} before jax starts"
            )
        return devs[: topo.chips]
    if topo.platform == "cuda":
        desc = topologies.get_topology_desc(
            platform="cuda", topology_name="", topology=topo.shape,
            target_config=_gpu_target_config(topo.kind),
        )  # fmt: skip
    else:
        per_host = min(topo.chips, TPU_PER_HOST[topo.kind])
        bounds = [1, 1, 1] if per_host == 1 else [2, per_host // 2, 1]
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{topo.kind}:{topo.shape}",
            chips_per_host_bounds=bounds,
        )  # fmt: skip
    devs = list(desc.devices)
    if len(devs) != topo.chips:
        raise ValueError(
            f"topology {topo.name}: the plugin made {len(devs)} devices, not {topo.chips}"
        )
    return devs


def fits(total_bytes: int, topo: Topology, fraction: float = 0.9) -> bool:
    """Whether a per-device total fits ``fraction`` of one chip's HBM."""
    return total_bytes <= math.floor(fraction * topo.hbm_bytes)
