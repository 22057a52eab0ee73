"""Kernel launches per decode step, counted in the compiled H100 rollout programs.

At decode sizes a step's time is mostly launches, so the rollout model (``gpu_rollout``) takes
their number from the programs the engines really run rather than from a list written by hand,
Qwen3-8B widths, compiled deviceless for H100 at 1 and 2 layers, FP8 (``quantize_params`` +
``fuse_projections``, W8A8, FP8 static KV cache, the Mosaic GPU kernels) and BF16 (BF16 weights
and cache, same attention kernel), on both engines:

* static (``generate``: prefill + a ``while_loop`` decode): one iteration of the decode loop;
* paged (``generate_paged``, one slot per row): one decode iteration of the engine loop, i.e. its
  body's own launches (slot release, page tables, the sampling state) and its decode branch,
  without the admission branch (prefill: once per request) or the page-growing loop's body
  (zero iterations unless the pool runs short).

Loop conditions evaluated every step count once. In a counted computation every fusion, custom
call (a Pallas kernel) and copy is one launch, a nested loop whose trip count XLA knows launches
its body that many times (``jnp.searchsorted``'s binary search was one); per layer = 2 layers
minus 1 layer, per step (LM head, sampling, bookkeeping) = 1 layer minus per layer. Kinds:
``mosaic`` (Mosaic GPU: GEMMs, attention), ``triton`` (Pallas Triton: ``act_quantize``, in the
FP8 program its producer-fused kernels), ``xla_gemm`` (XLA's GEMM fusions and cuBLAS calls),
``xla`` (every other fusion or copy). Counted apart (``decode_body_syncs``,
``paged_step_syncs``): the predicates the host reads in a step. XLA's GPU runtime evaluates a
``while`` without a known trip count by copying its predicate to the host and waiting before
every iteration, and a ``conditional`` by copying its branch index the same way: the stream
drains and the next launch starts from an idle GPU (``gpu.HOST_SYNC_S`` each), unless XLA
records the loop in a command buffer with device-side conditional nodes.

``python -m kernels_pallas.perf_model.hlo_launches`` (the AOT venv: the CUDA plugin) writes
``experiments/results/rollout_launches.json``; with ``--model qwen3-30b-a3b`` the MoE rollout's
counts (``rollout_launches_qwen3-30b-a3b.json``: ``gpu_rollout_moe``).
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


def branches(line: str) -> list[str]:
    """The branch computations of one ``conditional`` (an index's list, or a predicate's
    true / false pair)."""
    if m := re.search(r"branch_computations=\{([^}]*)\}", line):
        return re.findall(r"%?([\w.\-]+)", m.group(1))
    return re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)


def condition_launches(comps: dict[str, list[str]], line: str) -> collections.Counter:
    """Launches of one evaluation of a ``while``'s condition (it runs before every iteration
    and once more at the end)."""
    return launches(comps, re.search(r"condition=%?([\w.\-]+)", line).group(1))


def trip_count(line: str) -> int | None:
    """A ``while``'s trip count where XLA knows it (``backend_config``'s known_trip_count)."""
    m = re.search(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
    return int(m.group(1)) if m else None


def launches(comps: dict[str, list[str]], name: str) -> collections.Counter:
    """Launches by kind in computation ``name``, into nested loops, branches and calls."""
    count = collections.Counter()
    for line in comps[name]:
        if not (m := _OP.search(line)):
            continue
        op = m.group(1)
        if op == "while":  # a known trip count's n iterations (e.g. jnp.searchsorted's
            # binary search): its body n times, its condition n + 1; else body and condition
            # once (a loop of its own: its trips are not the step's)
            n = trip_count(line)
            body = launches(comps, re.search(r"body=%?([\w.\-]+)", line).group(1))
            cond = condition_launches(comps, line)
            count += collections.Counter({k: (n or 1) * v for k, v in body.items()})
            count += collections.Counter({k: (n + 1 if n else 1) * v for k, v in cond.items()})
        elif op == "conditional":
            for b in branches(line):
                count += launches(comps, b)
        elif op == "call":
            count += launches(comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
        else:
            count[_kind(line, op)] += 1
    return count


def _one_loop(comps: dict[str, list[str]], op_name: str, what: str, *,
              unknown_trips: bool = False) -> str:  # fmt: skip
    """The one ``while`` line whose op_name ends in ``op_name`` (``unknown_trips``: without a
    known trip count); an error naming ``what`` otherwise."""
    loops = [
        line
        for lines in comps.values()
        for line in lines
        if " while(" in line
        and re.search(op_name + '"', line)
        and not (unknown_trips and "known_trip_count" in line)
    ]
    if len(loops) != 1:
        raise ValueError(f"hlo_launches: expected one {what}, found {len(loops)}")
    return loops[0]


def _body(line: str) -> str:
    return re.search(r"body=%?([\w.\-]+)", line).group(1)


def decode_body_launches(hlo: str) -> collections.Counter:
    """Launches by kind in one iteration of ``generate``'s decode ``while_loop`` (the one loop
    of ``generate`` without a known trip count: prefill's chunk loop has one): its body and
    its condition."""
    comps = computations(hlo)
    loop = _one_loop(comps, r"_generate\)?/while", "decode while loop", unknown_trips=True)
    return launches(comps, _body(loop)) + condition_launches(comps, loop)


def _calls_kernel(comps: dict[str, list[str]], name: str, marker: str) -> bool:
    """Whether computation ``name`` (or one it runs) holds a custom call naming ``marker``."""
    for line in comps[name]:
        if "custom-call(" in line and marker in line:
            return True
        refs = re.findall(
            r"(?:body|to_apply|true_computation|false_computation)=%?([\w.\-]+)", line
        )
        for ref in refs + (branches(line) if " conditional(" in line else []):
            if ref in comps and _calls_kernel(comps, ref, marker):
                return True
    return False


def paged_step_launches(hlo: str, marker: str = "paged_attention") -> collections.Counter:
    """Launches by kind in one decode iteration of the paged engine's loop (``run_engine``):
    the loop body's own launches (the bookkeeping predicate, sampling's state updates,
    loop-carried copies) and its decode branch (the ``lax.cond`` whose branch runs the paged
    attention kernel), without the other branches (release / admission / page growth, taken
    only when ``bookkeeping_due``; prefill once per request) or a nested loop's body; the
    conditions of the loops in the body, evaluated every step, are counted."""
    comps = computations(hlo)
    loop = _one_loop(comps, r"run_engine\)/while", "paged engine loop")
    count, decode = condition_launches(comps, loop), 0
    for line in comps[_body(loop)]:
        if not (m := _OP.search(line)):
            continue
        if m.group(1) == "while":
            count += condition_launches(comps, line)
        elif m.group(1) == "conditional":
            for b in branches(line):
                if _calls_kernel(comps, b, marker):
                    count += launches(comps, b)
                    decode += 1
        elif m.group(1) == "call":
            count += launches(comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
        else:
            count[_kind(line, m.group(1))] += 1
    if decode != 1:
        raise ValueError(
            f"hlo_launches: expected one decode branch in the paged loop, found {decode}"
        )
    return count


def syncs(comps: dict[str, list[str]], name: str, marker: str | None = None) -> int:
    """Host reads of predicates in one run of computation ``name``: one per ``conditional``
    (its branch index) plus its taken branch's (``marker``: the branch that calls that kernel;
    without one, the branch with the most), one per ``while`` without a known trip count (its
    predicate, before an iteration: counted once, the loop as it runs in a decode step that
    needs none) and none inside it, a known trip count's body that many times, calls' own."""
    n = 0
    for line in comps[name]:
        if not (m := _OP.search(line)):
            continue
        if m.group(1) == "conditional":
            inner = [syncs(comps, b, marker) for b in branches(line)
                     if marker is None or _calls_kernel(comps, b, marker)]  # fmt: skip
            n += 1 + max(inner, default=0)
        elif m.group(1) == "while":
            if trips := re.search(r'"known_trip_count":\{"n":"(\d+)"', line):
                n += int(trips.group(1)) * syncs(comps, _body(line), marker)
            else:
                n += 1
        elif m.group(1) == "call":
            n += syncs(comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1), marker)
    return n


def decode_body_syncs(hlo: str) -> int:
    """Host syncs per iteration of ``generate``'s decode loop: its predicate and its body's."""
    comps = computations(hlo)
    loop = _one_loop(comps, r"_generate\)?/while", "decode while loop", unknown_trips=True)
    return 1 + syncs(comps, _body(loop))


def paged_step_syncs(hlo: str, marker: str = "paged_attention") -> int:
    """Host syncs per decode iteration of the paged engine's loop: its predicate, every
    ``conditional`` and loop predicate of its body, and those inside the decode branch (not
    inside the bookkeeping branch, skipped when not due)."""
    comps = computations(hlo)
    loop = _one_loop(comps, r"run_engine\)/while", "paged engine loop")
    return 1 + syncs(comps, _body(loop), marker)


@dataclasses.dataclass(frozen=True)
class Launches:
    """Launches per layer and per step (outside the layers) of one decode step, by kind, and
    the host syncs of its step (none per layer in either engine)."""

    per_layer: dict
    per_step: dict
    host_syncs: int = 0

    def total(self, layers: int) -> int:
        return layers * sum(self.per_layer.values()) + sum(self.per_step.values())


def split_layers(one: collections.Counter, two: collections.Counter,
                 host_syncs: tuple[int, int] = (0, 0)) -> Launches:  # fmt: skip
    """Per layer = 2 layers minus 1, per step = 1 layer minus per layer; ``host_syncs`` at
    1 and 2 layers must agree (a predicate per layer would be a new cost the model lacks)."""
    layer = {k: two[k] - one[k] for k in KINDS}
    if min(layer.values()) < 0:
        raise ValueError(f"hlo_launches: 2 layers launch less than 1 ({two} vs {one})")
    if host_syncs[0] != host_syncs[1]:
        raise ValueError(f"hlo_launches: host syncs per step differ by depth: {host_syncs}")
    return Launches(layer, {k: one[k] - layer[k] for k in KINDS}, host_syncs[0])


ENGINES = ("static", "paged")


PAGED_BEFORE = "paged_before"  # the paged engine's count before its bookkeeping went under a cond


@functools.cache  # read once: every rollout prediction (chip x batch) asks for it
def load(path: str = LAUNCHES_JSON, engine: str = "static") -> dict:
    """precision ("fp8" | "bf16") -> batch (str) -> Launches of ``engine``'s decode step, from
    the committed measurement (``PAGED_BEFORE``: the paged engine's earlier count, kept for
    the before -> after table)."""
    if engine not in (*ENGINES, PAGED_BEFORE):
        raise ValueError(f"hlo_launches.load: engine must be one of {ENGINES}, got {engine!r}")
    with open(path) as f:
        data = json.load(f)
    progs = (data["engines"]["paged"]["before_bookkeeping_cond"]["programs"]
             if engine == PAGED_BEFORE else data["engines"][engine]["programs"])  # fmt: skip
    # The earlier paged count has no syncs recorded: it read as many predicates per decode step
    # (the bookkeeping cond took the place of the admission cond at the top of the body).
    syncs_of = data["engines"]["paged"]["programs"] if engine == PAGED_BEFORE else progs
    return {
        prec: {
            b: Launches(v["per_layer"], v["per_step"], syncs_of[prec][b]["host_syncs"])
            for b, v in by_b.items()
        }
        for prec, by_b in progs.items()
    }


def _program(precision: str, layers: int, batch: int, prompt: int, response: int,
             engine: str = "static", model: str = "qwen3-8b"):  # fmt: skip
    """(fn, args) of the rollout at ``model``'s widths (a ``presets.PRESETS`` name;
    ``generation.aot_cases``): the static engine's ``generate``, or the paged engine with one
    slot per row."""
    from fp8rl_jax.generation import aot_cases as ac
    from fp8rl_jax.generation.sampling import SamplingConfig
    from fp8rl_jax.generation.static import generate
    from fp8rl_jax.models.presets import PRESETS
    from fp8rl_jax.quant import QuantRecipe

    cfg = dataclasses.replace(PRESETS[model], num_layers=layers)
    shape = ac.RolloutShape(batch=batch, prompt_len=prompt, max_new_tokens=response)
    if engine == "paged":
        kernels, page = ac.PAGED_IMPLS["h100"]
        fn = ac.paged_rollout_program(cfg, shape, QuantRecipe(), kernels, page, slots=batch,
                                      precision=precision)  # fmt: skip
        return fn, ac.rollout_args(cfg, shape)
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


ENGINE_NOTES = {
    "static": "generation.static.generate: one decode while_loop, launches of its body",
    "paged": "generation.paged.generate_paged, one slot per row, pages of 64: the engine loop's "
    "body and its decode branch (paged_step_launches: no admission/prefill, no page growing)",
}


def launches_json(model: str = "qwen3-8b") -> str:
    """Where ``model``'s counts are kept: ``LAUNCHES_JSON`` for Qwen3-8B, beside it for others."""
    return (
        LAUNCHES_JSON if model == "qwen3-8b" else LAUNCHES_JSON.replace(".json", f"_{model}.json")
    )


def measure(batches=(16, 32, 64, 128, 256), prompt: int = 2048, response: int = 4096,
            engines=ENGINES, model: str = "qwen3-8b") -> dict:  # fmt: skip
    """Compiles the programs (module docstring) at ``model``'s widths and counts their decode
    launches."""
    from kernels_pallas import aot

    aot.prepare_environment()
    import jax

    out = {}
    for engine in engines:
        static = engine == "static"
        count = decode_body_launches if static else paged_step_launches
        count_syncs = decode_body_syncs if static else paged_step_syncs
        progs = {}
        for prec in ("fp8", "bf16"):
            for b in batches:
                counts, n_syncs = [], []
                for layers in (1, 2):
                    fn, args = _program(prec, layers, b, prompt, response, engine, model)
                    hlo = aot.compile_for("h100", fn, *args).compiled.as_text()
                    counts.append(count(hlo))
                    n_syncs.append(count_syncs(hlo))
                    print(f"{engine} {prec} B={b} {layers} layer(s): {dict(counts[-1])}, "
                          f"{n_syncs[-1]} host syncs", flush=True)  # fmt: skip
                split = split_layers(*counts, host_syncs=tuple(n_syncs))
                progs.setdefault(prec, {})[str(b)] = dataclasses.asdict(split)
        out[engine] = dict(program=ENGINE_NOTES[engine], programs=progs)
    return dict(
        jax=jax.__version__, target="h100", model=f"{model} widths", prompt=prompt,
        response=response, engines=out,
    )  # fmt: skip


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", help="a presets.PRESETS name")
    ap.add_argument("--engine", action="append", choices=ENGINES, help="(repeatable; default both)")
    args = ap.parse_args(argv)
    path = launches_json(args.model)
    data = measure(engines=tuple(args.engine or ENGINES), model=args.model)
    before = None  # the earlier paged count is a record: keep it
    if os.path.exists(path):
        with open(path) as f:
            before = json.load(f).get("engines", {}).get("paged", {}).get("before_bookkeeping_cond")
    if before is not None and "paged" in data["engines"]:
        data["engines"]["paged"]["before_bookkeeping_cond"] = before
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
