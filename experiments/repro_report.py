"""The report of the miniature reproduction: per-arm statistics, comparison plots, REPORT.md.

Reads the runs that ``experiments/repro_fp8rl.py`` wrote under ``<out>/runs/<arm>/seed<s>/``.
"""

from __future__ import annotations

import json
import math
import os
import platform

import numpy as np

from experiments.configs import repro

DEFAULT_OUT = "experiments/results/repro"
WRITEUP_BEGIN = "<!-- writeup: kept when the report is regenerated -->"
WRITEUP_END = "<!-- /writeup -->"
SWEEP_FILE = "sweep.json"  # one record per invocation: argv, start, end, runs done
RUN_WALL_FILE = "repro_wall.json"  # per run: wall seconds of train()
KL_SMOOTH = 10  # moving-average window (steps) of the per-step curves in the plots


def run_dir(out: str, arm: str, seed: int) -> str:
    return os.path.join(out, "runs", arm, f"seed{seed}")


def read_run_metrics(rd: str) -> list[dict]:
    from fp8rl_jax.train.logging import read_metrics

    return read_metrics(rd)


def _runs(out: str, arm: str, seeds=None) -> list[tuple[int, str]]:
    """Finished runs ``(seed, run_dir)`` of an arm (only ``seeds`` if given)."""
    d = os.path.join(out, "runs", arm)
    if not os.path.isdir(d):
        return []
    found = []
    for name in sorted(os.listdir(d)):
        rd = os.path.join(d, name)
        finished = name.startswith("seed") and os.path.exists(os.path.join(rd, "summary.json"))
        if finished and (seeds is None or int(name[4:]) in seeds):
            found.append((int(name[4:]), rd))
    return found


def _mean_std(values) -> tuple[float, float]:
    v = np.asarray(values, float)
    if v.size == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _series(rows: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if key in r and math.isfinite(r[key])}


def arm_stats(out: str, arm: str, seeds=None) -> dict | None:
    runs = _runs(out, arm, seeds)
    if not runs:
        return None
    per_run = []
    for seed, rd in runs:
        rows = read_run_metrics(rd)
        ev = _series(rows, "eval_accuracy")
        steps = sorted(ev)

        def mean_of(key, rows=rows):
            vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
            return float(np.mean(vals)) if vals else math.nan

        def median_of(key, rows=rows):
            vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
            return float(np.median(vals)) if vals else math.nan

        rollout = [r["rollout_time_s"] for r in rows if "rollout_time_s" in r and r["step"] > 2]
        wall_path = os.path.join(rd, RUN_WALL_FILE)
        wall = _read_json(wall_path)["wall_s"] if os.path.exists(wall_path) else math.nan
        train_acc = [r["train_accuracy"] for r in rows if "train_accuracy" in r]
        per_run.append(
            dict(
                seed=seed,
                acc_first=ev[steps[0]],
                acc_last=ev[steps[-1]],
                acc_tail=float(np.mean([ev[t] for t in steps[-3:]])),
                last_step=steps[-1],
                kl=mean_of("kl"),
                k3_kl=mean_of("k3_kl"),
                tmpe=median_of("token_mult_prob_error"),  # rare huge spikes dominate a mean
                frac_high=mean_of("is_ratio_fraction_high"),
                frac_low=mean_of("is_ratio_fraction_low"),
                masked=mean_of("masked_token_fraction"),
                rollout_s=float(np.median(rollout)) if rollout else math.nan,
                train_acc_tail=float(np.mean(train_acc[-25:])) if train_acc else math.nan,
                wall_s=wall,
            )
        )
    stats = {"n": len(per_run), "seeds": [p["seed"] for p in per_run], "runs": per_run}
    for key in per_run[0]:
        if key != "seed":
            stats[key] = _mean_std([p[key] for p in per_run])
    return stats


def _baseline(arm: str) -> str:
    return "moe_bf16_none" if arm.startswith("moe") else "bf16_none"


def _curves(out: str, arm: str, key: str, smooth=1, paired=False, seeds=None):
    """Steps and mean/std over seeds of a metric (steps common to all seeds).

    paired: the metric minus the BF16 arm's on the same seed (seeds that both arms have).
    """
    runs = dict(_runs(out, arm, seeds))
    series = {seed: _series(read_run_metrics(rd), key) for seed, rd in runs.items()}
    if paired:
        if _baseline(arm) == arm:
            return None
        base_runs = _runs(out, _baseline(arm), seeds)
        base = {seed: _series(read_run_metrics(rd), key) for seed, rd in base_runs}
        series = {
            seed: {t: v - base[seed][t] for t, v in s.items() if t in base[seed]}
            for seed, s in series.items()
            if seed in base
        }
    series = [s for s in series.values() if s]
    if not series:
        return None
    steps = sorted(set.intersection(*(set(s) for s in series)))
    y = np.array([[s[t] for t in steps] for s in series])
    if smooth > 1 and y.shape[1] >= smooth:
        kernel = np.ones(smooth) / smooth
        y = np.array([np.convolve(row, kernel, mode="valid") for row in y])
        steps = steps[smooth - 1 :]
    std = y.std(axis=0, ddof=1) if len(y) > 1 else np.zeros(y.shape[1])
    return np.array(steps), y.mean(axis=0), std, len(y)


def plot_arms(
    out: str, arms, key, path, title, smooth=1, log=False, paired=False, seeds=None
) -> str | None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    drawn = 0
    for i, arm in enumerate(arms):
        c = _curves(out, arm, key, smooth, paired, seeds)
        if c is None:
            continue
        steps, mean, std, n = c
        color = f"C{i % 10}"
        style = "--" if arm.startswith("moe") else "-"
        marker = "o" if len(steps) < 30 else None
        ax.plot(steps, mean, style, color=color, marker=marker, ms=3, label=f"{arm} (n={n})")
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15)
        drawn += 1
    if not drawn:
        return None
    if log:  # BF16 arms have ~0 (even slightly negative) KL: linear below 1e-4
        ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _fmt(ms, spec=".3f", pm=True) -> str:
    mean, std = ms
    if not math.isfinite(mean):
        return "-"
    return f"{mean:{spec}} ± {std:{spec.lstrip('+')}}" if pm else f"{mean:{spec}}"


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import jax

    return (
        f"{cpu}, {os.cpu_count()} cores visible (shared with other developers' jobs and tests), "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"jax {jax.__version__} on {jax.default_backend()}"
    )


def _table(stats: dict) -> list[str]:
    lines = [
        "| arm | seeds | acc step 0 | final acc | vs BF16 (paired) | gain vs BF16 (paired) | "
        "last 3 evals | kl (k1) | token_mult_prob_error | frac >C | frac <1/C | masked | "
        "rollout s/step | wall s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in stats.items():
        if s is None:
            lines.append(f"| {arm} | 0 |" + " - |" * 12)
            continue
        base = stats.get(_baseline(arm))
        base_runs = {r["seed"]: r for r in base["runs"]} if base else {}
        pairs = [(r, base_runs[r["seed"]]) for r in s["runs"] if r["seed"] in base_runs]
        vs_bf16 = gain_vs_bf16 = "-"
        if pairs and base is not s:
            vs_bf16 = _fmt(_mean_std([r["acc_last"] - b["acc_last"] for r, b in pairs]), "+.3f")
            gains = [
                (r["acc_last"] - r["acc_first"]) - (b["acc_last"] - b["acc_first"])
                for r, b in pairs
            ]
            gain_vs_bf16 = _fmt(_mean_std(gains), "+.3f")
        lines.append(
            f"| {arm} | {s['n']} | {_fmt(s['acc_first'], pm=False)} | {_fmt(s['acc_last'])} | "
            f"{vs_bf16} | {gain_vs_bf16} | {_fmt(s['acc_tail'])} | {_fmt(s['kl'], '.2e', False)} | "
            f"{_fmt(s['tmpe'], '.4f', False)} | {_fmt(s['frac_high'], '.4f', False)} | "
            f"{_fmt(s['frac_low'], '.4f', False)} | {_fmt(s['masked'], '.4f', False)} | "
            f"{_fmt(s['rollout_s'], '.3f', False)} | {_fmt(s['wall_s'], '.0f', False)} |"
        )
    return lines


def write_report(
    out: str, arms, seeds, command: str, header=None, eval_size=None, sections=None
) -> str:
    """REPORT.md, summary.json and the PNGs of the runs under ``out``.

    Another sweep (``experiments/repro_long.py``) passes its own ``header`` (title and intro
    lines), ``eval_size`` (held-out problems) and ``sections`` (lines before "How it was run").
    """
    n_eval = eval_size or repro.EVAL_SIZE
    stats = {arm: arm_stats(out, arm, seeds) for arm in arms}
    all_stats = {arm: arm_stats(out, arm) for arm in arms}
    plots = []
    # mode: "" plain, "log" symlog y axis, "paired" minus the BF16 arm's on the same seed
    for key, name, title, smooth, mode in (
        (
            "eval_accuracy",
            "accuracy.png",
            "greedy held-out accuracy (mean ± std over seeds)",
            1,
            "",
        ),
        (
            "eval_accuracy",
            "accuracy_vs_bf16.png",
            "held-out accuracy minus the BF16 arm's on the same seed (mean ± std)",
            1,
            "paired",
        ),
        (
            "kl",
            "mismatch_kl.png",
            f"mismatch KL (k1), {KL_SMOOTH}-step moving avg",
            KL_SMOOTH,
            "log",
        ),
        ("reward_mean", "reward.png", f"train reward, {KL_SMOOTH}-step moving average", 10, ""),
    ):
        path = os.path.join(out, name)
        p = plot_arms(out, arms, key, path, title, smooth, mode == "log", mode == "paired", seeds)
        if p:
            plots.append((name, title))

    lines = header or [
        "# FP8-RL in miniature: rollout precision x rollout correction on a tiny policy",
        "",
        "Generated by `experiments/repro_fp8rl.py` (issue 8). Task: 2-digit addition (character "
        "tokenizer, `task.seed=0` for every run), tiny Qwen3-style policy (D=64, 2 layers; MoE: 4 "
        "experts, top-2), SFT warm start then GRPO. Seeds vary `trainer.seed` (model init, SFT, "
        "sampling). Arms are defined in `experiments/configs/repro.py`.",
        "",
    ]
    lines += [
        "## Table",
        "",
        "Accuracy: greedy held-out accuracy (rollout precision, "
        f"{n_eval} problems), mean ± sample std over seeds. Mismatch columns: means "
        "over all RL steps and seeds of the per-step metrics, except `token_mult_prob_error`: "
        "median over steps (one token with a huge ratio can make a step's mean spike to "
        "10-100), mean over seeds. `frac >C` / `frac <1/C`: "
        "`is_ratio_fraction_high/low` (tokens whose ratio π_old/π_rollout is above 2 / below 1/2; "
        "TIS clips the former, MIS masks both). `masked`: `masked_token_fraction`. Rollout: median "
        "seconds per rollout step (steps > 2), mean over seeds. `vs BF16`: final accuracy minus "
        "the BF16 arm's (`bf16_none`, or `moe_bf16_none` for MoE arms) on the same seed (same "
        "init and SFT), mean ± std over the paired seeds; `gain vs BF16`: the same for the gain "
        "final − step 0 (removes the part of the gap that is the quantized evaluation of the same "
        "SFT weights at step 0). `last 3 evals`: mean of each run's "
        "last three evaluations (less noisy than the final one).",
        "",
    ]
    lines += _table(stats)
    missing = [
        f"{arm} seed{x}" for arm, s in stats.items() for x in seeds if not s or x not in s["seeds"]
    ]
    extra = [a for a in arms if all_stats[a] and all_stats[a]["n"] > (stats[a] or {"n": 0})["n"]]
    if extra:
        shown = {a: all_stats[a] for a in arms if a in extra or a in map(_baseline, extra)}
        lines += [
            "",
            f"All finished seeds of the arms that have more than seeds {seeds[0]}-{seeds[-1]} "
            "(extra seeds for a tighter paired comparison):",
            "",
            *_table(shown),
        ]
    last_steps = sorted({r["last_step"] for s in stats.values() if s for r in s["runs"]})
    lines += [
        "",
        f"Final accuracy is at RL step {', '.join(map(str, last_steps))}.",
        "",
        "Per seed (final held-out accuracy):",
        "",
    ]
    for arm in arms:
        if all_stats[arm]:
            per = ", ".join(f"s{r['seed']}={r['acc_last']:.3f}" for r in all_stats[arm]["runs"])
            lines.append(f"- {arm}: {per}")
    if missing:
        lines += ["", f"**Missing runs** (not finished): {', '.join(missing)}."]
    lines += ["", "## Plots", ""]
    for name, title in plots:
        lines += [f"![{title}]({name})", ""]

    lines += sections or []
    sweeps = read_sweeps(out)
    walls = [r["wall_s"] for s in all_stats.values() if s for r in s["runs"]]
    lines += [
        "## How it was run",
        "",
        "Regenerate (resumes; finished runs are skipped, so this only redraws when all exist):",
        "",
        f"    {command}",
        "",
        f"Machine: {_machine()}.",
        "",
        f"Wall time: {sum(w for w in walls if math.isfinite(w)) / 60:.1f} min summed over "
        f"{len(walls)} runs (SFT, compilation, RL steps, evals each)",
    ]
    if sweeps:
        spans = "; ".join(
            f"{s['start']} -> {s.get('end', '(interrupted)')} ({s.get('runs_done', '?')} runs)"
            for s in sweeps
        )
        lines[-1] += f"; invocations: {spans}."
    else:
        lines[-1] += "."
    lines += [""]

    writeup = _existing_writeup(os.path.join(out, "REPORT.md"))
    lines += [WRITEUP_BEGIN, writeup or "## Reading\n\n(to be written)", WRITEUP_END, ""]
    path = os.path.join(out, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(stats, f, indent=1, default=float)
    return path


def _existing_writeup(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read()
    if WRITEUP_BEGIN in text and WRITEUP_END in text:
        return text.split(WRITEUP_BEGIN, 1)[1].split(WRITEUP_END, 1)[0].strip("\n")
    return None


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def read_sweeps(out: str) -> list[dict]:
    path = os.path.join(out, SWEEP_FILE)
    return _read_json(path) if os.path.exists(path) else []
