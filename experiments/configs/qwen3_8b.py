"""Qwen3-8B(-Base) on one 8xH100 node: the paper's dense experiment (E1/E3).

Parent: hf_base.py. Changes: run_dir. For several nodes use qwen3_8b_multihost.py, for a TPU
v6e-16 slice qwen3_8b_v6e.py.
  python experiments/train.py --config=experiments/configs/qwen3_8b.py \\
      --config.model.hf_checkpoint=/data/Qwen3-8B-Base --config.task.jsonl_path=/data/dapo.jsonl
"""

from experiments.configs import hf_base


def get_config():
    c = hf_base.get_config()
    c.trainer.run_dir = "runs/qwen3_8b"
    return c
