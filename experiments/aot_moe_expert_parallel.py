"""Deviceless compile of the expert-parallel FP8 MoE block for 8 H100s (Mosaic GPU kernels).

The rollout's MoE block at Qwen3-30B-A3B widths (E=128, top-8, D=2048, F=768): weight sync
(``quantize_params``) + ``moe_mlp`` on a mesh data=2 x expert=4 (32 experts per shard), a decode
step of 64 sequences and a prefill of 8 x 128 tokens (x split over data and expert). Reports the
FP8 operands of the kernels (the per-device expert stacks), the collectives, and ptxas
registers/spills of the kernels.

  PYTHONPATH=$PWD /work/main/.aot/venv/bin/python experiments/aot_moe_expert_parallel.py
"""

from __future__ import annotations

import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kernels_pallas import aot  # noqa: E402

aot.prepare_environment()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fp8rl_jax.models.aot_cases import QWEN3_30B_A3B, _args, _moe_block  # noqa: E402

# (phase, B, T): 64 decoding sequences; a prefill of 8 prompts x 128 tokens (rows split 8 ways)
TOKENS = (("decode", 64, 1), ("prefill", 8, 128))


def h100_mesh(data: int, expert: int) -> Mesh:
    topo = topologies.get_topology_desc(
        platform="cuda", topology_name="", topology=f"1x1x{data * expert}",
        target_config=aot.H100_TARGET_CONFIG,
    )  # fmt: skip
    devs = np.array(topo.devices).reshape(data, 1, expert, 1)
    return Mesh(devs, ("data", "fsdp", "expert", "tensor"), axis_types=(AxisType.Auto,) * 4)


def _kernel_f8_operands(hlo: str) -> list[str]:
    """FP8 operand shapes of the Mosaic GPU custom calls (or of every dot, for the XLA path)."""
    shapes = set()
    for line in hlo.splitlines():
        if "mosaic_gpu" in line and "custom-call(" in line:
            args = line.split("custom-call(", 1)[1]
            shapes.update(re.findall(r"f8e4m3fn\[[\d,]*\]", args))
    return sorted(shapes)


def compile_case(mesh: Mesh, b: int, t: int, impl: str) -> dict:
    mlp, x = _args(QWEN3_30B_A3B, b, t)
    w_spec = {"router": P(), "w_gate": P("expert"), "w_up": P("expert"), "w_down": P("expert")}
    mlp = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, w_spec[k]))
        for k, v in mlp.items()
    }
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(("data", "expert"))))
    fn = jax.jit(lambda p, x: _moe_block(p, x, QWEN3_30B_A3B, impl))
    with aot._mosaic_gpu_dump() as reports, jax.set_mesh(mesh):
        compiled = fn.lower(mlp, x).compile()
    hlo = compiled.as_text()
    ops = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    coll = {}
    for line in hlo.splitlines():
        m = re.search(r"= (.+?) (" + "|".join(ops) + r")(?:-start)?\(", line)
        if m:
            coll.setdefault(m.group(2), set()).add(re.sub(r"\{[\d,]*\}", "", m.group(1))[:80])
    return {
        "kernels": aot.count_kernels(hlo, "h100"),
        "kernel_f8_operands": _kernel_f8_operands(hlo),
        "collectives": {k: sorted(v) for k, v in coll.items()},
        "ptxas": [
            dict(registers=r.registers, spills=r.spill_stores + r.spill_loads) for r in reports
        ],  # fmt: skip
    }


def main() -> None:
    mesh = h100_mesh(2, 4)
    out = {}
    for phase, b, t in TOKENS:
        for impl in ("pallas_mosaic_gpu", "xla"):
            try:
                out[f"{phase}:{impl}"] = compile_case(mesh, b, t, impl)
            except Exception as e:  # report and go on
                out[f"{phase}:{impl}"] = {"error": aot.one_line(e)}
            print(phase, impl, json.dumps(out[f"{phase}:{impl}"]), flush=True)
    path = os.path.join(REPO, "experiments/results/aot_moe_expert_parallel.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
