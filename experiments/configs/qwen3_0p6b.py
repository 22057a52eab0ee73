"""Qwen3-0.6B on one GPU: the smallest real model, for trying the recipe end to end.

Parent: hf_base.py. Changes: run_dir; 8192-token responses fit one H100 with an FP8 KV cache.
  python experiments/train.py --config=experiments/configs/qwen3_0p6b.py \\
      --config.model.hf_checkpoint=/data/Qwen3-0.6B --config.task.jsonl_path=/data/math.jsonl
"""

from experiments.configs import hf_base


def get_config():
    c = hf_base.get_config()
    c.trainer.run_dir = "runs/qwen3_0p6b"
    return c
