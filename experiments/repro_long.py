"""The long-response regime in miniature (issue 24, item 3): rollout precision x correction at
responses of 39-159 tokens, where mismatch has length to accumulate.

Trains the tiny policy on the ``chain`` task (written repeated subtraction) under the arms of
``experiments/configs/repro_long.py`` (BF16 rollout; FP8 without correction, + token TIS,
+ token MIS; FP8 with ``rl.train_precision="fp8_rollout"``) for several ``trainer.seed`` values,
one run at a time in this process (the runner of ``repro_fp8rl.py``). Then writes
``<out>/REPORT.md`` (the table of ``repro_report.py`` plus mismatch KL by response position and
by response length) and PNGs (mean over seeds, shaded ± std).

    .venv/bin/python experiments/repro_long.py                # 5 arms x 3 seeds
    .venv/bin/python experiments/repro_long.py --report-only  # redraw the report from the runs
    .venv/bin/python experiments/repro_long.py --quick --out=/tmp/q  # smoke: 2 arms, 1 seed

Resumable as ``repro_fp8rl.py``: a run with ``<out>/runs/<arm>/seed<s>/summary.json`` is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments.configs import repro_long  # noqa: E402
from experiments.repro_fp8rl import run_sweep, sweep_cli  # noqa: E402
from experiments.repro_report import (  # noqa: E402
    _fmt,
    _mean_std,
    _runs,
    _series,
    plot_arms,
    read_run_metrics,
    run_dir,
    write_report,
)

DEFAULT_OUT = "experiments/results/repro_long"
QUICK_ARMS = ("bf16_none", "fp8_none")
# (metric, its count, plot file, title): mismatch by response position / response length
LENGTH_CURVES = (
    ("kl_pos", "tokens_pos", "kl_vs_position.png", "token mismatch KL (k1) vs response position"),
    (
        "seq_kl_len",
        "seqs_len",
        "kl_vs_length.png",
        "sequence mismatch Σ KL (k1) vs response length",
    ),
)


def arm_config(arm: str, seed: int, out: str, steps: int | None, quick: bool):
    c = repro_long.get_config(arm)
    c.trainer.seed = seed
    c.trainer.run_dir = run_dir(out, arm, seed)
    if quick:  # CI-sized: no warm start, short chains, a few RL steps on small batches
        c.sft.steps = 0
        c.task.min_steps, c.task.max_steps = 2, 10  # 7-39 tokens: two length buckets
        c.rollout.max_new_tokens = 40
        c.rl.group_size = 4
        c.rl.num_minibatches = 1
        c.trainer.prompts_per_step = 4
        c.trainer.steps = 2
        c.trainer.eval_every = 0
        c.trainer.eval_size = 8
    if steps is not None:
        c.trainer.steps = steps
    return c


class SFTCache:
    """Reuses one SFT warm start per seed across the arms (SFT does not depend on the arm).

    Wraps ``trainer.sft_warm_start`` for the sweep: the key hashes the initial weights, the model
    and SFT configs and the first demonstration batch, so only runs whose warm start would be
    bit-identical share it (5 arms -> one SFT per seed instead of five).
    """

    def __init__(self):
        self.results: dict[str, tuple] = {}
        self.hits = 0

    def key(self, params, model_cfg, cfg, make_batch) -> str:
        import jax

        h = hashlib.blake2b(repr((model_cfg, cfg)).encode(), digest_size=16)
        for leaf in jax.tree.leaves((params, make_batch(0))):
            h.update(np.asarray(leaf).tobytes())
        return h.hexdigest()

    @contextlib.contextmanager
    def patch(self):
        from fp8rl_jax.train import trainer

        original = trainer.sft_warm_start

        def cached(params, model_cfg, cfg, make_batch, progress=None):
            k = self.key(params, model_cfg, cfg, make_batch)
            if k in self.results:
                self.hits += 1
            else:
                self.results[k] = original(params, model_cfg, cfg, make_batch, progress)
            return self.results[k]

        trainer.sft_warm_start = cached
        try:
            yield self
        finally:
            trainer.sft_warm_start = original


def length_profile(rows: list[dict], key: str, count_key: str) -> dict[int, float]:
    """Bucket start -> the count-weighted mean of ``key<start>`` over a run's steps."""
    sums: dict[int, float] = {}
    counts: dict[int, float] = {}
    for r in rows:
        for name, value in r.items():
            if name.startswith(count_key) and name[len(count_key) :].isdigit():
                a = int(name[len(count_key) :])
                n, v = float(value), r.get(f"{key}{a}", math.nan)
                if n > 0 and math.isfinite(v):
                    sums[a] = sums.get(a, 0.0) + n * v
                    counts[a] = counts.get(a, 0.0) + n
    return {a: sums[a] / counts[a] for a in sorted(sums)}


def arm_profiles(out: str, arm: str, key: str, count_key: str, seeds=None):
    """(bucket starts, mean, std over seeds) of an arm's length profile (buckets all seeds have)."""
    profiles = [
        length_profile(read_run_metrics(rd), key, count_key) for _, rd in _runs(out, arm, seeds)
    ]
    profiles = [p for p in profiles if p]
    if not profiles:
        return None
    starts = sorted(set.intersection(*(set(p) for p in profiles)))
    y = np.array([[p[a] for a in starts] for p in profiles])
    std = y.std(axis=0, ddof=1) if len(y) > 1 else np.zeros(len(starts))
    return np.array(starts), y.mean(axis=0), std, len(y)


def plot_length_curves(out: str, arms, seeds) -> list[str]:
    """One PNG per LENGTH_CURVES entry; the report lines: a table and the images."""
    from matplotlib.figure import Figure

    lines = ["## Mismatch vs response length", ""]
    for key, count_key, name, title in LENGTH_CURVES:
        fig = Figure(figsize=(7.5, 4.5))
        ax = fig.subplots()
        rows = []
        for i, arm in enumerate(arms):
            prof = arm_profiles(out, arm, key, count_key, seeds)
            if prof is None:
                continue
            starts, mean, std, n = prof
            ax.errorbar(starts, mean, yerr=std, marker="o", color=f"C{i}", label=f"{arm} (n={n})")
            rows.append((arm, dict(zip(starts.tolist(), zip(mean, std, strict=True), strict=True))))
        if not rows:
            continue
        ax.set_xscale("symlog", linthresh=32)
        ax.set_yscale("symlog", linthresh=1e-4)  # BF16 arms sit near 0
        ax.set_xlabel("bucket start (response tokens; buckets [0,32), [32,64), [64,128), ...)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.savefig(os.path.join(out, name), dpi=110, bbox_inches="tight")
        starts = sorted({a for _, d in rows for a in d})
        lines += [
            f"{title} (`{key}<a>`, weighted by `{count_key}<a>` over each run's steps; mean ± std "
            "over seeds):",
            "",
            "| arm | " + " | ".join(f"[{a}, ...)" for a in starts) + " |",
            "|---|" + "---|" * len(starts),
        ]
        for arm, d in rows:
            cells = [f"{d[a][0]:.2e} ± {d[a][1]:.1e}" if a in d else "-" for a in starts]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines += ["", f"![{title}]({name})", ""]
    return lines


def reward_section(out: str, arms, seeds) -> list[str]:
    """Held-out mean reward (exact chains 1, wrong ones partial credit x right steps): a table of
    step 0, final and gain (each paired with ``bf16_none`` on the same seed) and its curve."""
    runs = {arm: dict(_runs(out, arm, seeds)) for arm in arms}
    series = {
        arm: {s: _series(read_run_metrics(rd), "eval_reward") for s, rd in r.items()}
        for arm, r in runs.items()
    }
    series = {arm: {s: v for s, v in d.items() if v} for arm, d in series.items()}
    if not any(series.values()):
        return []
    title = "held-out mean reward (partial credit), mean ± std over seeds"
    lines = [
        "## Held-out mean reward",
        "",
        "Greedy held-out reward under the task's own reward (1 for an exact chain, else "
        f"{repro_long.PARTIAL_CREDIT} x the share of right steps, at least the format reward): "
        "a finer measure than exact match, whose few percent move by one problem in "
        f"{repro_long.EVAL_SIZE}. `gain` = final − step 0; `gain vs BF16`: minus `bf16_none`'s "
        "gain on the same seed. Mean ± sample std over seeds.",
        "",
        "| arm | seeds | step 0 | final | gain | gain vs BF16 (paired) |",
        "|---|---|---|---|---|---|",
    ]

    def gain(d):
        return d[max(d)] - d[min(d)]

    base = series.get("bf16_none", {})
    for arm, d in series.items():
        if not d:
            lines.append(f"| {arm} | 0 | - | - | - | - |")
            continue
        first = _mean_std([v[min(v)] for v in d.values()])
        last = _mean_std([v[max(v)] for v in d.values()])
        gains = _mean_std([gain(v) for v in d.values()])
        paired = [gain(v) - gain(base[s]) for s, v in d.items() if s in base]
        vs = "-" if arm == "bf16_none" or not paired else _fmt(_mean_std(paired), "+.3f")
        lines.append(
            f"| {arm} | {len(d)} | {_fmt(first)} | {_fmt(last)} | {_fmt(gains, '+.3f')} | {vs} |"
        )
    if plot_arms(
        out, arms, "eval_reward", os.path.join(out, "eval_reward.png"), title, seeds=seeds
    ):
        lines += ["", f"![{title}](eval_reward.png)"]
    return [*lines, ""]


def header_lines() -> list[str]:
    rl = repro_long
    return [
        "# FP8-RL in miniature, long responses: rollout precision x correction at 39-159 tokens",
        "",
        "Generated by `experiments/repro_long.py` (issue 24, item 3). Task: `chain` (written "
        f"repeated subtraction `ch:0347-7=` -> `0340,0333,...,0004`, {rl.MIN_STEPS}-"
        f"{rl.MAX_STEPS} steps of 4 tokens, stride 1-{rl.MAX_STRIDE}; exact match of the whole "
        "chain; character tokenizer, `task.seed=0`), tiny Qwen3-style policy (D=64, 2 layers), "
        f"{rl.SFT_STEPS} SFT steps then GRPO ({rl.PROMPTS_PER_STEP} prompts x {rl.GROUP_SIZE} "
        f"responses per step), rollouts on the {rl.ENGINE} engine. Seeds vary `trainer.seed` "
        "(model init, SFT, sampling). Arms are defined in `experiments/configs/repro_long.py`; "
        "`fp8train_none` scores and trains in the rollout's FP8 numerics "
        '(`rl.train_precision="fp8_rollout"`).',
        "",
    ]


def main(argv=None) -> int:
    def sweep(arms, seeds, out, args):
        with SFTCache().patch() as cache:
            done = run_sweep(
                arms, seeds, out, args.steps, args.quick, args.keep_checkpoints, arm_config
            )
        print(f"SFT warm starts reused: {cache.hits}")
        return done

    args, arms, seeds, out, command = sweep_cli(
        argv, script="repro_long.py", description=__doc__.split("\n\n")[0],
        all_arms=repro_long.ARMS, quick_arms=QUICK_ARMS,
        default_seeds=3, default_out=DEFAULT_OUT, quick_out="runs/repro_long_quick", sweep=sweep,
    )  # fmt: skip
    eval_size = 8 if args.quick else repro_long.EVAL_SIZE
    path = write_report(
        out, arms, seeds, command, header=header_lines(), eval_size=eval_size,
        sections=reward_section(out, arms, seeds) + plot_length_curves(out, arms, seeds),
    )  # fmt: skip
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
