"""Kernel launches per decode step, counted in the compiled H100 rollout programs.

At decode sizes a step's time is mostly launches, so the rollout model (``gpu_rollout``) takes
their number from the programs the engine really runs rather than from a list written by hand: the
static engine's ``generate`` (prefill + ``while_loop`` decode), Qwen3-8B widths, compiled
deviceless for H100 at 1 and 2 layers, FP8 (``quantize_params`` + ``fuse_projections``, W8A8, FP8
static KV cache, the Mosaic GPU kernels) and BF16 (BF16 weights and cache, same attention kernel).
In the decode loop's body every fusion, custom call (a Pallas kernel) and copy is one launch; per
layer = 2 layers minus 1 layer, per step (LM head, sampling, bookkeeping) = 1 layer minus per
layer. Kinds: ``mosaic`` (Mosaic GPU: GEMMs, attention), ``triton`` (Pallas Triton:
``act_quantize``, in the FP8 program its producer-fused kernels), ``xla_gemm`` (XLA's GEMM fusions
and cuBLAS calls), ``xla`` (every other fusion or copy).

``python -m kernels_pallas.perf_model.hlo_launches`` (the AOT venv: the CUDA plugin) writes
``experiments/results/rollout_launches.json``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re

LAUNCHES_JSON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "experiments", "results", "rollout_launches.json",
)  # fmt: skip
KINDS = ("mosaic", "triton", "xla_gemm", "xla")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_OP = re.compile(r"= .*? (fusion|custom-call|while|conditional|call|copy)\(")


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from compiled HLO text."""
    out, name = {}, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and (m := _HEADER.match(line)):
            name, out[m.group(1)] = m.group(1), []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def _kind(line: str, op: str) -> str:
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        if "mosaic" in target:
            return "mosaic"
        return "triton" if "triton" in target else "xla_gemm" if "gemm" in target else "xla"
    if op == "fusion" and re.search(r"calls=%?[\w.\-]*gemm", line):
        return "xla_gemm"
    return "xla"


def launches(comps: dict[str, list[str]], name: str) -> collections.Counter:
    """Launches by kind in computation ``name``, into nested loops, branches and calls."""
    count = collections.Counter()
    for line in comps[name]:
        if not (m := _OP.search(line)):
            continue
        op = m.group(1)
        if op == "while":
            count += launches(comps, re.search(r"body=%?([\w.\-]+)", line).group(1))
        elif op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
            for b in re.findall(r"%?([\w.\-]+)", branches):
                count += launches(comps, b)
        elif op == "call":
            count += launches(comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
        else:
            count[_kind(line, op)] += 1
    return count


def decode_body_launches(hlo: str) -> collections.Counter:
    """Launches by kind in one iteration of ``generate``'s decode ``while_loop`` (the one loop
    of ``generate`` without a known trip count: prefill's chunk loop has one)."""
    comps = computations(hlo)
    bodies = [
        re.search(r"body=%?([\w.\-]+)", line).group(1)
        for lines in comps.values()
        for line in lines
        if " while(" in line
        and re.search(r'_generate\)?/while"', line)
        and "known_trip_count" not in line
    ]
    if len(bodies) != 1:
        raise ValueError(f"hlo_launches: expected one decode while loop, found {len(bodies)}")
    return launches(comps, bodies[0])


@dataclasses.dataclass(frozen=True)
class Launches:
    """Launches per layer and per step (outside the layers) of one decode step, by kind."""

    per_layer: dict
    per_step: dict

    def total(self, layers: int) -> int:
        return layers * sum(self.per_layer.values()) + sum(self.per_step.values())


def split_layers(one: collections.Counter, two: collections.Counter) -> Launches:
    layer = {k: two[k] - one[k] for k in KINDS}
    if min(layer.values()) < 0:
        raise ValueError(f"hlo_launches: 2 layers launch less than 1 ({two} vs {one})")
    return Launches(layer, {k: one[k] - layer[k] for k in KINDS})


@functools.cache  # read once: every rollout prediction (chip x batch) asks for it
def load(path: str = LAUNCHES_JSON) -> dict:
    """precision ("fp8" | "bf16") -> batch (str) -> Launches, from the committed measurement."""
    with open(path) as f:
        data = json.load(f)
    return {
        prec: {b: Launches(v["per_layer"], v["per_step"]) for b, v in by_b.items()}
        for prec, by_b in data["programs"].items()
    }


def _program(precision: str, layers: int, batch: int, prompt: int, response: int):
    """(fn, args) of the static-engine rollout at Qwen3-8B widths (``generation.aot_cases``)."""
    from fp8rl_jax.generation import aot_cases as ac
    from fp8rl_jax.generation.sampling import SamplingConfig
    from fp8rl_jax.generation.static import generate
    from fp8rl_jax.models.presets import QWEN3_8B
    from fp8rl_jax.quant import QuantRecipe

    cfg = dataclasses.replace(QWEN3_8B, num_layers=layers)
    shape = ac.RolloutShape(batch=batch, prompt_len=prompt, max_new_tokens=response)
    kernels = ac.IMPLS["h100"]
    if precision == "fp8":
        fn = ac.rollout_program(cfg, shape, QuantRecipe(), "float8_e4m3fn", kernels)
    else:

        def fn(params, tokens_BP, lens_B, rng, k_LK, v_LK):
            del k_LK, v_LK
            return generate(
                params, (tokens_BP, lens_B), cfg, SamplingConfig(temperature=1.0), rng,
                kv_cache_dtype="bfloat16", max_new_tokens=response, stop_token_ids=ac.STOP_IDS,
                kernels=kernels,
            )  # fmt: skip

    return fn, ac.rollout_args(cfg, shape)


def measure(batches=(16, 64, 128, 256), prompt: int = 2048, response: int = 4096) -> dict:
    """Compiles the programs (module docstring) and counts their decode launches."""
    from kernels_pallas import aot

    aot.prepare_environment()
    import jax

    out = {}
    for prec in ("fp8", "bf16"):
        for b in batches:
            counts = []
            for layers in (1, 2):
                fn, args = _program(prec, layers, b, prompt, response)
                hlo = aot.compile_for("h100", fn, *args).compiled.as_text()
                counts.append(decode_body_launches(hlo))
                print(f"{prec} B={b} {layers} layer(s): {dict(counts[-1])}", flush=True)
            out.setdefault(prec, {})[str(b)] = dataclasses.asdict(split_layers(*counts))
    return dict(
        jax=jax.__version__, target="h100", engine="static (generation.static.generate)",
        model="Qwen3-8B widths", prompt=prompt, response=response, programs=out,
    )  # fmt: skip


def main() -> None:
    data = measure()
    with open(LAUNCHES_JSON, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"-> {LAUNCHES_JSON}")


if __name__ == "__main__":
    main()
