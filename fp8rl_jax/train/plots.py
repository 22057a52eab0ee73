"""PNG plots of a run's metrics.jsonl, and sweep comparisons.

Figures are drawn with `matplotlib.figure.Figure` (Agg canvas) rather than pyplot, so plotting
from a training process or a notebook never touches the global backend or leaks figures.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

from matplotlib.figure import Figure

from fp8rl_jax.train.logging import read_metrics

# One PNG per panel; every metric whose name matches the regex is a line in it (train and eval).
PANELS: dict[str, str] = {
    "reward": r"(^|/)reward(s)?(_mean|/mean)?$",
    "accuracy": r"(^|[/_])acc(uracy)?(_mean|/mean)?$",
    "mismatch_kl": r"(^|/)(mismatch_)?(kl|k3_kl)$",
    "rollout_time": r"(^|/)(rollout_time|rollout_s|time/rollout)(_s)?$",
}


def _series(records: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and "step" in record:
            steps.append(record["step"])
            values.append(value)
    return steps, values


def _plot_lines(ax, lines: dict[str, tuple[list[float], list[float]]]) -> None:
    for label, (steps, values) in sorted(lines.items()):
        sparse = len(steps) < 30  # eval metrics come every few steps: show the points
        ax.plot(steps, values, marker="o" if sparse else None, markersize=3, label=label)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_run(run_dir: str | os.PathLike[str]) -> list[str]:
    """Writes `run_dir/plots/<panel>.png` for each panel of PANELS that has data; returns paths.

    Missing metrics are skipped; a run without metrics.jsonl yields no plots.
    """
    records = read_metrics(run_dir)
    keys = sorted({k for r in records for k in r if k != "step"})
    out_dir = os.path.join(run_dir, "plots")
    written = []
    for panel, pattern in PANELS.items():
        matching = [k for k in keys if re.search(pattern, k)]
        lines = {k: _series(records, k) for k in matching}
        lines = {k: s for k, s in lines.items() if any(math.isfinite(v) for v in s[1])}
        if not lines:
            continue
        os.makedirs(out_dir, exist_ok=True)
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        _plot_lines(ax, lines)
        ax.set_title(f"{os.path.basename(os.path.normpath(run_dir))}: {panel}")
        path = os.path.join(out_dir, f"{panel}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        written.append(path)
    return written


def plot_compare(
    run_dirs: Sequence[str | os.PathLike[str]],
    labels: Sequence[str],
    out_png: str | os.PathLike[str],
    key: str,
) -> str:
    """One line per run of metric `key` against step (e.g. BF16 vs FP8 rollouts); returns the path.

    Runs without the key are left out of the legend; raises ValueError if no run has it.
    """
    if len(run_dirs) != len(labels):
        raise ValueError(f"{len(run_dirs)} run dirs but {len(labels)} labels")
    lines = {}
    for run_dir, label in zip(run_dirs, labels):
        steps, values = _series(read_metrics(run_dir), key)
        if steps:
            lines[label] = (steps, values)
    if not lines:
        raise ValueError(f"no run in {list(map(str, run_dirs))} has metric {key!r}")
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    _plot_lines(ax, lines)
    ax.set_ylabel(key)
    out_png = os.fspath(out_png)
    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    return out_png
