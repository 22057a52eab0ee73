"""The planner: compile every program of a run for a target, deviceless, and report its memory.

``plan_programs`` builds an experiment's programs the way the trainer does, through the same
functions (``experiment_from_config`` -> ``setup.abstract_train_state`` ->
``train.placement.OnMesh`` -> ``setup.run_programs``, i.e. ``rl.build_programs`` with the
placement's shardings) on a mesh of compile-only devices (``train.topology``), lowers each with
``ShapeDtypeStruct`` inputs that carry their shardings, compiles it, and reads XLA's per-device
``memory_analysis()``. The programs: ``rollout`` and ``train`` (every step), ``gen_rollout``
(DAPO generation batches of another row count), ``eval`` (greedy held-out generation). Total =
arguments + outputs - aliased + temp.

Compiling a 36-layer model takes minutes: ``extrapolate`` fits ``bytes(L) = a + b·L`` to two
small depths per program and field and predicts the full depth (checked against a full compile
in experiments/results/plan_full_depth.json).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from fp8rl_jax.train.topology import GIB, Topology, devices, fits

log = logging.getLogger(__name__)
FIELDS = ("argument", "output", "alias", "temp")
FIT_FRACTION = 0.9  # a program fits when its per-device total is <= this share of HBM


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (XLA ``memory_analysis``)."""

    program: str  # rollout | train | gen_rollout | eval
    argument: int  # inputs (the state, prompts / batch)
    output: int  # results
    alias: int  # outputs that reuse donated inputs (counted once)
    temp: int  # temporaries (activations, KV cache, logits, gathered weights)
    compile_s: float  # seconds to lower + compile (summed over the depths extrapolated from)
    layers: str  # "36" compiled, or "1,2->36" extrapolated

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    def as_dict(self, topo: Topology) -> dict:
        gib = {f"{f}_gib": round(getattr(self, f) / GIB, 3) for f in (*FIELDS, "total")}
        return dict(program=self.program, **gib, hbm_gib=round(topo.hbm_bytes / GIB, 2),
                    fits=fits(self.total, topo, FIT_FRACTION), compile_s=round(self.compile_s, 1),
                    layers=self.layers, knob=knob(self, topo))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program and the abstract (sharded) arguments it is lowered with."""

    name: str
    fn: object  # a jax.jit-wrapped function
    args: tuple


def _sharded(abstract, shardings):
    from fp8rl_jax.train import sharding as sh

    return sh.abstract_with_shardings(abstract, shardings)


def build_run_programs(exp, model_cfg, mesh, prompt_len: int):
    """``(programs, shardings, abstract state)`` of a run of ``exp`` on ``mesh``, through the
    trainer's functions (``trainer._train``)."""
    from fp8rl_jax.train.optim import make_optimizer
    from fp8rl_jax.train.placement import OnMesh, program_rows
    from fp8rl_jax.train.setup import abstract_train_state, run_programs

    state = abstract_train_state(exp, model_cfg)
    place = OnMesh(mesh, model_cfg, state, prompt_len, program_rows(exp)[0])
    programs = run_programs(exp, model_cfg, place, make_optimizer(exp.optim))
    return programs, place.shardings(exp), state


def plan_programs(exp, model_cfg, mesh, prompt_len: int) -> list[Program]:
    """The programs a run of ``exp`` executes on ``mesh``, built as the trainer builds them."""
    from fp8rl_jax.rl import rollout_fn
    from fp8rl_jax.train import sharding as sh
    from fp8rl_jax.train.placement import program_rows

    programs, s, state = build_run_programs(exp, model_cfg, mesh, prompt_len)
    rows, gen_rows, eval_rows = program_rows(exp)
    state_in = _sharded(state, s.step.state)

    def prompts_in(n, shardings):  # as OnMesh places them: split over the batch axes
        return _sharded(sh.abstract_prompts(n, prompt_len), shardings)

    prompts = sh.abstract_prompts(rows, prompt_len)
    batch = jax.eval_shape(rollout_fn(model_cfg, exp.rollout, exp.rl), state, prompts)
    rewards = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=s.step.rewards)
    out = [
        Program("rollout", programs.rollout, (state_in, prompts_in(rows, s.step.prompts))),
        Program("train", programs.train, (state_in, _sharded(batch, s.step.batch), rewards)),
    ]
    if s.gen is not None:  # DAPO generation batches of another row count
        gen_in = (state_in, prompts_in(gen_rows, s.gen.prompts))
        out.append(Program("gen_rollout", programs.gen_rollout, gen_in))
    eval_in = (state_in.params, prompts_in(eval_rows, s.eval_prompts), state_in.kv_scales)
    out.append(Program("eval", programs.eval, eval_in))
    return out


def compile_memory(program: Program, mesh, layers: int) -> ProgramMemory:
    """Lowers and compiles ``program`` under ``mesh``; its per-device memory."""
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = program.fn.lower(*program.args).compile()
    secs = time.perf_counter() - t0
    m = compiled.memory_analysis()
    return ProgramMemory(
        program=program.name,
        argument=int(m.argument_size_in_bytes),
        output=int(m.output_size_in_bytes),
        alias=int(m.alias_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        compile_s=secs,
        layers=str(layers),
    )


def make_planning_mesh(exp, topo: Topology):
    """The run's mesh (``exp.mesh``) over the compile-only devices of ``topo``."""
    from fp8rl_jax.train import sharding as sh

    return sh.make_mesh(exp.mesh, devices(topo))


def plan(exp, model_cfg, topo: Topology, prompt_len: int, only=None) -> list[ProgramMemory]:
    """Compiles every program of ``exp`` (``only``: those named) for ``topo``."""
    mesh = make_planning_mesh(exp, topo)
    out = []
    for p in plan_programs(exp, model_cfg, mesh, prompt_len):
        if only is None or p.name in only:
            out.append(compile_memory(p, mesh, model_cfg.num_layers))
            log.info("%s at %d layers: %s", p.name, model_cfg.num_layers, out[-1].as_dict(topo))
    return out


def extrapolate(small: ProgramMemory, large: ProgramMemory, l_small: int, l_large: int,
                l_full: int) -> ProgramMemory:  # fmt: skip
    """Per field ``bytes(L) = a + b·L`` through the two compiles, evaluated at ``l_full``, with
    the slope ``b`` clamped at 0: a field that shrank from the shallower compile to the deeper one
    (XLA scheduled the two programs differently; seen for Qwen3-30B-A3B's rollout on v5p-64, whose
    2,4-layer line fell to 0.3 GiB of temporaries at 48 layers) keeps its shallower value rather
    than extrapolating the fall."""
    if l_large <= l_small:
        raise ValueError(f"extrapolate: depths must grow, got {l_small} then {l_large}")

    def line(f):
        lo, hi = getattr(small, f), getattr(large, f)
        slope = max(0.0, (hi - lo) / (l_large - l_small))
        return round(lo + slope * (l_full - l_small))

    return ProgramMemory(
        program=small.program, **{f: line(f) for f in FIELDS},
        compile_s=small.compile_s + large.compile_s, layers=f"{l_small},{l_large}->{l_full}",
    )  # fmt: skip


def plan_extrapolated(exp, model_cfg, topo: Topology, prompt_len: int,
                      depths: tuple[int, int], only=None) -> list[ProgramMemory]:  # fmt: skip
    """``plan`` at two depths, extrapolated per program to ``model_cfg.num_layers``."""
    runs = [
        plan(exp, dataclasses.replace(model_cfg, num_layers=d), topo, prompt_len, only)
        for d in depths
    ]
    return [extrapolate(a, b, *depths, model_cfg.num_layers) for a, b in zip(*runs, strict=True)]


# The train program's bytes per layer grow with depth (Qwen3-8B on 8xH100, ordered block remat:
# 0.62 GiB per layer from 2 to 4 layers, 1.06 from 8 to 16; 36 layers compiled: 43.2 GiB, where
# 2,4 extrapolated to 29.9 and 8,16 to 42.7; experiments/results/plan_depth_check.json).
TRAIN_MIN_DEPTH = 8


def depth_warning(results: list[ProgramMemory], depths: tuple[int, ...]) -> str | None:
    """A line when a train program was extrapolated from depths below ``TRAIN_MIN_DEPTH`` (its
    figure is then a lower bound), else None."""
    if len(depths) != 2 or min(depths) >= TRAIN_MIN_DEPTH:
        return None
    if not any(m.program == "train" for m in results):
        return None
    return (
        f"train extrapolated from {depths[0]},{depths[1]} layers is a lower bound: its bytes per "
        f"layer grow with depth (Qwen3-8B, 8xH100: 2,4 layers -> 29.9 GiB, the 36-layer compile "
        f"43.2); --layers={TRAIN_MIN_DEPTH},{2 * TRAIN_MIN_DEPTH} came within 1%"
    )


# What to turn when a program does not fit, by program and by where its bytes are.
KNOBS = {
    "rollout": (
        "rollout.engine='paged' with rollout.paged.kv_memory_bytes (KV pool from a budget), "
        "rl.logprob_chunk / rl.score_micro_batch (scoring without [B, T, V] logits), fewer rows "
        "per device (trainer.prompts_per_step, rl.dapo.gen_prompts) or a mesh.tensor axis"
    ),
    "gen_rollout": "rl.dapo.gen_prompts, rollout.paged.kv_memory_bytes, rl.score_micro_batch",
    "eval": "trainer.eval_size, rollout.engine='paged' with rollout.paged.kv_memory_bytes",
    "train": (
        "rl.grad_accum (rows per micro-batch), rl.logprob_chunk (loss without [B, T, V] "
        "logits), rl.remat ('block'), rl.num_minibatches, or a mesh.tensor axis"
    ),
}
STATE_KNOB = "more weight shards: mesh.fsdp / mesh.expert / mesh.tensor (or more chips)"


def knob(m: ProgramMemory, topo: Topology) -> str:
    """The config fields to turn when ``m`` does not fit ``topo`` ("" when it fits)."""
    if fits(m.total, topo, FIT_FRACTION):
        return ""
    if m.argument > FIT_FRACTION * topo.hbm_bytes / 2:  # the state alone takes half the budget
        return STATE_KNOB
    return KNOBS[m.program]


def format_table(results: list[ProgramMemory], topo: Topology) -> str:
    """A fixed-width table of per-device GiB, one row per program."""
    head = (f"{'program':<12}{'args':>9}{'temp':>10}{'out':>9}{'alias':>9}{'total':>10}"
            f"{'HBM':>8}  fits  {'compile s':>9}  layers")  # fmt: skip
    lines = [head]
    for m in results:
        d = m.as_dict(topo)
        lines.append(
            f"{m.program:<12}{d['argument_gib']:>9.2f}{d['temp_gib']:>10.2f}{d['output_gib']:>9.2f}"
            f"{d['alias_gib']:>9.2f}{d['total_gib']:>10.2f}{d['hbm_gib']:>8.1f}  "
            f"{'yes ' if d['fits'] else 'NO  '}  {d['compile_s']:>9.1f}  {m.layers}"
        )
    lines += [f"  {m.program}: does not fit; turn {knob(m, topo)}" for m in results
              if knob(m, topo)]  # fmt: skip
    return "\n".join(lines)
