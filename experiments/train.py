"""Train a policy with FP8 rollouts: ``python experiments/train.py --config=CONFIG[:ARG]``.

Any field can be overridden, e.g. ``--config.rollout.kv_cache_dtype=float8_e4m3fn``. Outputs
(resolved config, metrics.jsonl, TensorBoard events, checkpoints, plots, summary.json) go to
``config.trainer.run_dir``; re-running with the same run_dir resumes from its last checkpoint.
Errors print one line (``--verbose``: the traceback); SIGINT / SIGTERM save the current step and
exit 130 / 143 with the line to resume.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fp8rl_jax.train.cli import one_line_errors, parse_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")


@one_line_errors
def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
    from fp8rl_jax.train.distributed import maybe_initialize_distributed
    from fp8rl_jax.train.experiment import experiment_from_config
    from fp8rl_jax.train.trainer import train

    exp = experiment_from_config(_CONFIG.value)
    maybe_initialize_distributed(exp.distributed)  # before any jax computation
    from fp8rl_jax.train.checks import device_summary

    print(f"devices: {device_summary()}")
    summary = train(exp)  # writes config.json once it knows the run can start or resume
    print(
        f"outputs in {summary['run_dir']}: metrics.jsonl, events (TensorBoard), "
        f"checkpoints/, plots/, summary.json"
    )
    print(f"held-out accuracy {summary['eval_accuracy_first']} -> {summary['eval_accuracy_last']}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main, flags_parser=parse_flags)
