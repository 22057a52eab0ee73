"""Run outputs: metrics as JSON lines, TensorBoard events and optionally W&B (process 0 only),
resolved config.

A resumed run passes its first step as `resume_step`; every record at or after it is dropped from
`metrics.jsonl` (and purged in TensorBoard), so the run keeps one clean history. W&B continues the
same W&B run (its id is kept in the run directory) but keeps steps only increasing: replayed steps
below its last logged one are dropped there (W&B warns), later steps are logged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from fp8rl_jax.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
LOGGERS = ("jsonl", "tensorboard", "wandb")


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        else:
            array = np.asarray(
                value
            )  # device -> host here, in the host loop, never in library code
            if array.size != 1:
                raise ValueError(f"metric {name!r} must be a scalar, got shape {array.shape}")
            flat[name] = float(array.reshape(()))
    return flat


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, float]]:
    """All records of `run_dir/metrics.jsonl` (NaN/Inf round-trip); a torn last line is skipped."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash mid-write
    return records


class MetricsLogger:
    """Appends `{"step": s, name: float, ...}` lines to metrics.jsonl and scalars to TensorBoard.

    Nested dicts are flattened with "/" ("rollout/kl"). On processes other than 0 every method is
    a no-op. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        resume_step: int = 0,
        tensorboard: bool = True,
        process_index: int | None = None,
    ):
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, METRICS_FILE)
        self.active = _process_index(process_index) == 0
        self._file = None
        self._writer = None
        if not self.active:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        kept = [r for r in read_metrics(self.run_dir) if r.get("step", math.inf) < resume_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(
                os.path.join(self.run_dir, TENSORBOARD_DIR), purge_step=resume_step or None
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one record; values are scalars (python, numpy or jax) or nested dicts of them."""
        if not self.active:
            return
        flat = _flatten(metrics)
        if "step" in flat:
            raise ValueError("'step' is reserved; pass it as the step argument")
        self._file.write(json.dumps({"step": int(step), **flat}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for name, value in flat.items():
                self._writer.add_scalar(name, value, global_step=int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _process_index(process_index: int | None) -> int:
    return jax.process_index() if process_index is None else process_index


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError("the 'wandb' logger needs wandb: pip install 'fp8rl_jax[wandb]'") from e
    return wandb


def _wandb_run_id(run_dir: str, resume: bool) -> str:
    """The run's W&B id, kept in the run directory: a resume continues it, a fresh run gets a
    new one (as it starts a clean metrics.jsonl)."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resume and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    run_id = secrets.token_hex(4)  # W&B ids: letters and digits
    atomic_write_text(path, run_id + "\n")
    return run_id


class WandbLogger:
    """Logs the records `MetricsLogger` writes, under the same flattened names, to W&B.

    Project from `project`, else $WANDB_PROJECT, else "fp8rl_jax"; run name = the run
    directory's name; files under $WANDB_DIR, else the run directory. $WANDB_MODE=offline (or
    `mode`) writes locally for a later `wandb sync`. Only process 0 logs.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        config: Any = None,
        project: str | None = None,
        mode: str | None = None,
        resume_step: int = 0,
        process_index: int | None = None,
    ):
        self.run_dir = os.fspath(run_dir)
        self.active = _process_index(process_index) == 0
        self._run = None
        if not self.active:
            return
        wandb = _import_wandb()
        os.makedirs(self.run_dir, exist_ok=True)
        self._run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "fp8rl_jax",
            name=os.path.basename(os.path.abspath(self.run_dir)),
            id=_wandb_run_id(self.run_dir, resume=resume_step > 0),
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or self.run_dir,
            config=jsonable(config) if config is not None else None,
            mode=mode,
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        flat = _flatten(metrics)
        if "step" in flat:
            raise ValueError("'step' is reserved; pass it as the step argument")
        self._run.log(flat, step=int(step))

    def flush(self) -> None:
        """Nothing to flush here: W&B's own service process writes the run's files."""

    def close(self) -> None:
        """Finishes the run; W&B's service process may still be writing its files (at exit,
        or on `wandb.teardown()`, W&B waits for it)."""
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LoggerGroup:
    """Several loggers behind one `log` / `flush` / `close`."""

    def __init__(self, loggers):
        self.loggers = tuple(loggers)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def flush(self) -> None:
        for logger in self.loggers:
            logger.flush()

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()

    def __enter__(self) -> LoggerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_metrics_logger(
    run_dir: str | os.PathLike[str],
    loggers: tuple[str, ...] = ("jsonl", "tensorboard"),
    *,
    resume_step: int = 0,
    config: Any = None,
    process_index: int | None = None,
) -> MetricsLogger | LoggerGroup:
    """The loggers named in `loggers` (a subset of LOGGERS that includes "jsonl": resuming and
    the plots read metrics.jsonl)."""
    unknown = [name for name in loggers if name not in LOGGERS]
    if unknown or "jsonl" not in loggers:
        raise ValueError(f"loggers must include 'jsonl' and be among {LOGGERS}, got {loggers!r}")
    wandb = None
    if "wandb" in loggers:  # first: if wandb is missing, no file is left open
        wandb = WandbLogger(
            run_dir, config=config, resume_step=resume_step, process_index=process_index
        )
    jsonl = MetricsLogger(
        run_dir,
        resume_step=resume_step,
        tensorboard="tensorboard" in loggers,
        process_index=process_index,
    )
    return jsonl if wandb is None else LoggerGroup((jsonl, wandb))


def jsonable(value: Any) -> Any:
    """``value`` as JSON-able data: dataclasses and ConfigDicts as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
        return jsonable(value.to_dict())
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


def write_resolved_config(
    run_dir: str | os.PathLike[str], config: Any, *, process_index: int | None = None
) -> str | None:
    """Writes `run_dir/config.json` (sorted keys, indented) from a dataclass, ConfigDict or dict.

    Returns the path, or None on processes other than 0.
    """
    index = jax.process_index() if process_index is None else process_index
    if index != 0:
        return None
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    atomic_write_text(path, json.dumps(jsonable(config), indent=2, sort_keys=True) + "\n")
    return path
