"""Reproduces the FP8-RL paper's claims in miniature (issue 8): one tiny policy, many rollout arms.

Trains the same tiny policy on the same task (2-digit addition, fixed ``task.seed``) under the arms
of ``experiments/configs/repro.py`` (BF16 / FP8 W8A8 / + FP8 KV / harsh E5M2 rollouts, with no
correction, token TIS or token MIS; a tiny MoE under BF16 and FP8+TIS), for several
``trainer.seed`` values (model init, SFT, sampling), one run at a time in this process. Then
writes ``<out>/REPORT.md`` (table: held-out accuracy mean ± std over seeds, mismatch metrics,
rollout time) and comparison PNGs (mean over seeds, shaded ± std).

    .venv/bin/python experiments/repro_fp8rl.py                # 9 arms x 5 seeds, ~50 min
    .venv/bin/python experiments/repro_fp8rl.py --report-only  # redraw the report from the runs
    .venv/bin/python experiments/repro_fp8rl.py --quick --out=/tmp/q  # smoke: 2 arms, 1 seed

Resumable: a run whose ``<out>/runs/<arm>/seed<s>/summary.json`` exists is skipped, so re-running
the same command finishes an interrupted sweep. Text between the write-up markers of an existing
REPORT.md is kept when the report is regenerated.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments.configs import repro  # noqa: E402
from experiments.repro_report import (  # noqa: E402
    DEFAULT_OUT,
    RUN_WALL_FILE,
    SWEEP_FILE,
    read_run_metrics,
    read_sweeps,
    run_dir,
    write_report,
)

QUICK_ARMS = ("bf16_none", "fp8_tis")


def arm_config(arm: str, seed: int, out: str, steps: int | None, quick: bool):
    c = repro.get_config(arm)
    c.trainer.seed = seed
    c.trainer.run_dir = run_dir(out, arm, seed)
    if quick:  # CI-sized: a few SFT/RL steps on small batches
        c.sft.steps = 0  # no warm start: saves a compilation (accuracy stays ~0)
        c.rl.group_size = 4
        c.rl.num_minibatches = 1
        c.trainer.prompts_per_step = 4
        c.trainer.steps = 2
        c.trainer.eval_every = 0
        c.trainer.eval_size = 16
    if steps is not None:
        c.trainer.steps = steps
    return c


def run_sweep(
    arms, seeds, out: str, steps: int | None, quick: bool, keep_checkpoints: bool,
    config_fn=None,
):  # fmt: skip
    """Runs every (arm, seed) without summary.json, one at a time; returns runs done now.

    ``config_fn(arm, seed, out, steps, quick)``: the run's config (default: this sweep's).
    """
    config_fn = config_fn or arm_config
    import jax

    from fp8rl_jax.train.experiment import experiment_from_config
    from fp8rl_jax.train.trainer import train

    # Seed-major: every arm gets seed 0 before any gets seed 1, so a cut-short sweep still
    # covers all arms.
    todo = [(a, s) for s in seeds for a in arms]
    t_sweep, done_now = time.perf_counter(), 0
    for i, (arm, seed) in enumerate(todo, 1):
        rd = run_dir(out, arm, seed)
        if os.path.exists(os.path.join(rd, "summary.json")):
            print(f"[{i}/{len(todo)}] {arm} seed={seed}: done before, skipped", flush=True)
            continue
        config = config_fn(arm, seed, out, steps, quick)
        exp = experiment_from_config(config)
        os.makedirs(rd, exist_ok=True)  # the trainer records the resolved config.json
        t0 = time.perf_counter()
        summary = train(exp, progress=False)
        wall = time.perf_counter() - t0
        with open(os.path.join(rd, RUN_WALL_FILE), "w") as f:
            json.dump({"wall_s": wall, "finished": _now()}, f)
        if not keep_checkpoints:  # finished runs are never resumed; keep the outputs small
            # (TensorBoard events hold the same scalars as metrics.jsonl)
            for name in ("checkpoints", "tensorboard"):
                shutil.rmtree(os.path.join(rd, name), ignore_errors=True)
        jax.clear_caches()
        done_now += 1
        elapsed = time.perf_counter() - t_sweep
        left = sum(
            not os.path.exists(os.path.join(run_dir(out, a, s), "summary.json"))
            for a, s in todo[i:]
        )
        rows = read_run_metrics(rd)
        kl = np.mean([r["kl"] for r in rows if "kl" in r])
        print(
            f"[{i}/{len(todo)}] {arm} seed={seed}: held-out acc "
            f"{summary['eval_accuracy_first']:.3f} -> {summary['eval_accuracy_last']:.3f}, "
            f"kl {kl:.2e}, {wall:.0f} s (sweep {elapsed / 60:.1f} min, "
            f"~{left * elapsed / done_now / 60:.0f} min left)",
            flush=True,
        )
    return done_now


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# Report


def _write_sweeps(out: str, sweeps: list[dict]) -> None:
    with open(os.path.join(out, SWEEP_FILE), "w") as f:
        json.dump(sweeps, f, indent=1)


def sweep_cli(argv, *, script: str, description: str, all_arms, quick_arms, default_seeds: int,
              default_out: str, quick_out: str, sweep):  # fmt: skip
    """The sweep drivers' shared command line: parses ``argv``, picks the arms, seeds and output
    folder, and unless ``--report-only`` runs ``sweep(arms, seeds, out, args)`` (returns the runs
    done) between a start and an end record in ``<out>/SWEEP_FILE``. Returns
    ``(args, arms, seeds, out, command)``; the caller writes its report."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help=f"output folder (default {default_out})")
    p.add_argument("--arms", default=None, help=f"comma list of {tuple(all_arms)}")
    p.add_argument("--seeds", type=int, default=default_seeds, help="trainer.seed = 0 .. N-1")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: config)")
    p.add_argument("--quick", action="store_true", help="smoke check: 2 arms, 1 seed, 2 steps")
    p.add_argument("--report-only", action="store_true", help="only redraw REPORT.md and PNGs")
    p.add_argument(
        "--keep-checkpoints", action="store_true", help="keep checkpoints/ and tensorboard/"
    )
    args = p.parse_args(argv)
    arms = list(quick_arms if args.quick else all_arms)
    seeds = [0] if args.quick else list(range(args.seeds))
    out = args.out or (quick_out if args.quick else default_out)
    if args.arms:
        arms = args.arms.split(",")
        bad = [a for a in arms if a not in all_arms]
        if bad:
            p.error(f"unknown arms {bad}; expected some of {tuple(all_arms)}")
    os.makedirs(out, exist_ok=True)
    command = f".venv/bin/python experiments/{script} " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"
    )
    if not args.report_only:
        sweeps = read_sweeps(out)
        record = {"argv": command.strip(), "start": _now()}
        sweeps.append(record)
        _write_sweeps(out, sweeps)
        record["runs_done"] = sweep(arms, seeds, out, args)
        record["end"] = _now()
        _write_sweeps(out, sweeps)
    return args, arms, seeds, out, command.strip()


def main(argv=None) -> int:
    def sweep(arms, seeds, out, args):
        return run_sweep(arms, seeds, out, args.steps, args.quick, args.keep_checkpoints)

    _, arms, seeds, out, command = sweep_cli(
        argv, script="repro_fp8rl.py", description=__doc__.split("\n\n")[0],
        all_arms=repro.ARMS, quick_arms=QUICK_ARMS, default_seeds=5, default_out=DEFAULT_OUT,
        quick_out="runs/repro_quick", sweep=sweep,
    )  # fmt: skip
    path = write_report(out, arms, seeds, command)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
