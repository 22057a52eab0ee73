"""fp8rl_jax.train: checkpoints, metrics logging, plots and config conversion for the trainer."""

from fp8rl_jax.train.checkpoint import CheckpointManager, Restored
from fp8rl_jax.train.config import ConfigError, from_config_dict
from fp8rl_jax.train.logging import (
    LOGGERS,
    LoggerGroup,
    MetricsLogger,
    WandbLogger,
    make_metrics_logger,
    read_metrics,
    write_resolved_config,
)

_LAZY = {"plot_run", "plot_compare"}  # matplotlib costs ~0.4 s to import: load it on first use


def __getattr__(name: str):
    if name in _LAZY:
        from fp8rl_jax.train import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOGGERS",
    "CheckpointManager",
    "ConfigError",
    "LoggerGroup",
    "MetricsLogger",
    "Restored",
    "WandbLogger",
    "from_config_dict",
    "make_metrics_logger",
    "plot_compare",
    "plot_run",
    "read_metrics",
    "write_resolved_config",
]
