"""Export a run's trained policy as an HF checkpoint: the same --config as the run, plus --out.

    .venv/bin/python experiments/export_hf.py --config=experiments/configs/tiny.py:fp8_tis \
        --out=exports/tiny_fp8_tis [--format=fp8]

--out must be a new or empty directory or a previous export (it holds ``fp8rl_export.json``),
which is replaced. --overwrite writes into any other directory: files of the same names are
replaced, nothing else is deleted. The run directory itself is refused.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fp8rl_jax.train.cli import one_line_errors, parse_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's experiment config file.")
_OUT = flags.DEFINE_string("out", None, "Output directory for config.json + *.safetensors.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Exported weight dtype.")
_FORMAT = flags.DEFINE_enum(
    "format",
    "bf16",
    ["bf16", "fp8"],
    "bf16: the trained weights; fp8: the rollout policy in "
    "block FP8 (weight + weight_scale_inv, quantization_config: vLLM/SGLang load it as is).",
)
_UNSERVABLE = flags.DEFINE_enum(
    "unservable",
    "error",
    ["error", "bf16"],
    "--format=fp8: a weight vLLM/SGLang/transformers would load wrong (sizes not multiples of "
    "the weight block, a fused q/k/v or gate/up group of mixed precision): error, or write it "
    "in BF16 and list it in quantization_config.ignored_layers.",
)
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Write into a non-empty --out that is not a previous export."
)


@one_line_errors
def main(argv):
    del argv
    from absl import logging as absl_logging

    from fp8rl_jax.train.experiment import experiment_from_config
    from fp8rl_jax.train.export import export_hf

    exp = experiment_from_config(_CONFIG.value)
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every restore at INFO
    step = export_hf(
        exp,
        _OUT.value,
        dtype=_DTYPE.value,
        fmt=_FORMAT.value,
        overwrite=_OVERWRITE.value,
        unservable=_UNSERVABLE.value,
    )
    print(f"exported step {step} of {exp.trainer.run_dir} to {os.path.abspath(_OUT.value)}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "out"])
    app.run(main, flags_parser=parse_flags)
