"""The planner: compile every program of a run for a target, deviceless, and report its memory.

``plan_programs`` builds an experiment's programs the way the trainer does
(``experiment_from_config`` -> ``init_train_state`` under ``jax.eval_shape`` ->
``train.placement.OnMesh`` -> ``sharding.step_shardings`` / ``rl.jit_steps``) on a mesh of
compile-only devices (``train.topology``), lowers each with ``ShapeDtypeStruct`` inputs that
carry their shardings, compiles it, and reads XLA's per-device ``memory_analysis()``. The programs:
``rollout`` and ``train`` (every step), ``gen_rollout`` (DAPO generation batches of another row
count), ``eval`` (greedy held-out generation). Total = arguments + outputs - aliased + temp.

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


def abstract_state(exp, model_cfg, prompt_len: int):
    """The trainer's abstract train state (``trainer._train``): FP32 params, optimizer, scales."""
    from fp8rl_jax.generation import Prompts, calibrate_initial_kv_scales
    from fp8rl_jax.models import init_weights
    from fp8rl_jax.rl import init_train_state
    from fp8rl_jax.train.optim import make_optimizer

    optimizer = make_optimizer(exp.optim)
    key = jax.random.key(0)
    params = jax.eval_shape(lambda: init_weights(model_cfg, key, jnp.float32))
    kv_scales = None
    if exp.rollout.static_kv_scales:
        one = Prompts(jnp.zeros((1, prompt_len), jnp.int32), jnp.ones((1,), jnp.int32))
        kv_scales = jax.eval_shape(
            lambda p: calibrate_initial_kv_scales(p, one, model_cfg, exp.rollout), params
        )
    state = jax.eval_shape(
        lambda p, s: init_train_state(p, optimizer, key, s, rl_cfg=exp.rl), params, kv_scales
    )
    return state, optimizer


def plan_programs(exp, model_cfg, mesh, prompt_len: int) -> list[Program]:
    """The programs a run of ``exp`` executes on ``mesh``, built as the trainer builds them."""
    from fp8rl_jax.rl import rollout_fn
    from fp8rl_jax.train import sharding as sh
    from fp8rl_jax.train.placement import OnMesh
    from fp8rl_jax.train.trainer import eval_program

    state, optimizer = abstract_state(exp, model_cfg, prompt_len)
    rows = exp.trainer.prompts_per_step * exp.rl.group_size
    place = OnMesh(mesh, model_cfg, state, prompt_len, rows)
    state_in = _sharded(state, place.state_sh)
    steps = place.steps(model_cfg, exp, optimizer)

    def prompts_in(n):  # as OnMesh places them: split over the batch axes
        prompts = sh.abstract_prompts(n, prompt_len)
        return _sharded(prompts, sh.batch_shardings(prompts, mesh))

    prompts = sh.abstract_prompts(rows, prompt_len)
    s = sh.step_shardings(model_cfg, exp.rollout, exp.rl, mesh, state, prompts)
    batch = jax.eval_shape(rollout_fn(model_cfg, exp.rollout, exp.rl), state, prompts)
    rewards = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=s.rewards)
    out = [
        Program("rollout", steps.rollout, (state_in, prompts_in(rows))),
        Program("train", steps.train, (state_in, _sharded(batch, s.batch), rewards)),
    ]
    dapo = exp.rl.dapo
    gen_rows = (dapo.gen_prompts or exp.trainer.prompts_per_step) * exp.rl.group_size
    if dapo.dynamic_sampling and gen_rows != rows:
        gen = place.gen_rollout(model_cfg, exp, gen_rows, steps.rollout)
        out.append(Program("gen_rollout", gen, (state_in, prompts_in(gen_rows))))
    n = exp.trainer.eval_size
    fn = place.jit_eval(eval_program(model_cfg, exp.rollout, place.pin_rollout_params), n)
    out.append(Program("eval", fn, (state_in.params, prompts_in(n), state_in.kv_scales)))
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
    """Per field ``bytes(L) = a + b·L`` through the two compiles, evaluated at ``l_full``."""
    if l_large <= l_small:
        raise ValueError(f"extrapolate: depths must grow, got {l_small} then {l_large}")

    def line(f):
        lo, hi = getattr(small, f), getattr(large, f)
        return max(0, round(lo + (hi - lo) * (l_full - l_small) / (l_large - l_small)))

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
