"""One owner for the compiled programs (``rl.programs``): the package jits nowhere else, the
trainer runs only the builder's programs, and the planner compiles the very functions the builder
returns (so what it measures is what the trainer runs)."""

import ast
import sys
from pathlib import Path

import jax
import numpy as np

from experiments.configs import tiny
from experiments.configs.defaults import set_path
from fp8rl_jax.rl import Programs
from fp8rl_jax.train import plan as P
from fp8rl_jax.train import plan_models, setup, trainer
from fp8rl_jax.train.experiment import experiment_from_config
from fp8rl_jax.train.topology import parse_topology
from tests.test_train_dapo import SCRIPT, SMALL

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = "fp8rl_jax/rl/programs.py"
# Where the package may write ``jax.jit``: the programs module, and jitted entry points below
# the ``rl`` floor that are called outside any program too (inside one they are inlined).
# ``kernels_pallas/`` (outside the package) jits its kernel wrappers itself.
ALLOWED = {
    PROGRAMS: "every program of a run",
    "fp8rl_jax/generation/static.py": "the static engine's entry (``generate``, static args)",
    "fp8rl_jax/generation/paged/engine.py": "the paged engine's entry (``run_engine``)",
    "fp8rl_jax/models/hf/io.py": "the NaN/Inf check of a loaded checkpoint (one fused pass)",
}


def _jit_lines(source: str) -> list[int]:
    """Lines of code (not strings or comments) that name ``jit`` or ``pjit``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        if name in ("jit", "pjit"):
            lines.append(getattr(node, "lineno", 0))
    return sorted(lines)


def test_jit_sites_are_only_in_the_allowed_modules():
    found = {}
    for path in sorted((REPO / "fp8rl_jax").rglob("*.py")):
        if lines := _jit_lines(path.read_text()):
            found[path.relative_to(REPO).as_posix()] = lines
    assert set(found) - set(ALLOWED) == set(), {k: v for k, v in found.items() if k not in ALLOWED}
    assert set(ALLOWED) - set(found) == set(), "an allowed module no longer jits: drop it"
    assert _jit_lines("import jax\nf = jax.jit(g)\n@functools.partial(jax.jit, x=1)\ndef h(): pass")


def _dapo_experiment(run_dir):
    """test_train_dapo's run (the same programs: compiled once per suite run, then cached)."""
    config = tiny.get_config("fp8_tis")
    for path, value in {**SMALL, "trainer.run_dir": str(run_dir)}.items():
        set_path(config, path, value)
    return experiment_from_config(config)


class _Counted:
    """A program that counts its calls (and is otherwise the program)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_the_trainer_runs_only_the_builders_programs(tmp_path, monkeypatch):
    """A DAPO run (step-0 calibration, generation batches, row selection, key folds, train, eval)
    calls only the programs of ``setup.run_programs``; no module of the package but
    ``rl.programs`` creates a jitted function while it runs."""
    built: list[Programs] = []
    real_run_programs = setup.run_programs

    def spy(*args):
        p = real_run_programs(*args)
        counted = Programs(**{k: _Counted(v) for k, v in vars(p).items()})
        built.append(counted)
        return counted

    jit_callers = []
    real_jit = jax.jit

    def jit(*args, **kwargs):
        jit_callers.append(sys._getframe(1).f_code.co_filename)
        return real_jit(*args, **kwargs)

    monkeypatch.setattr(trainer, "run_programs", spy)
    monkeypatch.setattr(jax, "jit", jit)

    script = iter(SCRIPT)

    def scripted(task, examples, completions):
        return np.asarray(next(script), np.float32), 0.5

    trainer.train(_dapo_experiment(tmp_path), progress=False, reward_fn=scripted)
    (programs,) = built
    calls = {k: v.calls for k, v in vars(programs).items()}
    # SCRIPT: 2 + 2 + 3 generation batches (a key fold for each but a step's first); eval before
    # the first step and after the last; the rollout of the step's own size is never needed.
    assert calls == {"rollout": 0, "gen_rollout": 7, "select_rows": 7, "fold_key": 4,
                     "train": 3, "eval": 2, "calibrate": 1}, calls  # fmt: skip
    package = (REPO / "fp8rl_jax").as_posix()
    ours = {Path(f).relative_to(REPO).as_posix() for f in jit_callers if f.startswith(package)}
    assert ours == {PROGRAMS}, ours


def test_the_planner_compiles_the_builders_programs(monkeypatch):
    """``plan_programs`` lowers the functions ``setup.run_programs`` returned, none of its own,
    with the shardings ``OnMesh.shardings`` gives (the trainer's path)."""
    built: list[Programs] = []
    real_run_programs = setup.run_programs

    def spy(*args):
        built.append(real_run_programs(*args))
        return built[-1]

    monkeypatch.setattr(setup, "run_programs", spy)
    config = tiny.get_config("fp8_tis")
    config.trainer.prompts_per_step, config.rl.group_size, config.trainer.eval_size = 2, 2, 4
    config.rl.dapo.dynamic_sampling, config.rl.dapo.gen_prompts = True, 3
    exp, cfg, _ = plan_models.experiment_and_model(config, "experiments/configs/tiny.py")
    mesh = P.make_planning_mesh(exp, parse_topology("cpu-1"))
    planned = {p.name: p.fn for p in P.plan_programs(exp, cfg, mesh, prompt_len=8)}
    (programs,) = built
    assert planned == {
        "rollout": programs.rollout,
        "train": programs.train,
        "gen_rollout": programs.gen_rollout,  # 3 prompts a generation batch, not the step's 2
        "eval": programs.eval,
    }
    assert programs.gen_rollout is not programs.rollout
