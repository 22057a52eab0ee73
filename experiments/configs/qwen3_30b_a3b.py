"""Qwen3-30B-A3B(-Base) MoE: the paper's MoE experiment (E2), router kept high precision.

Parent: hf_base.py. Changes: run_dir; the MoE router stays BF16 (quant.exclude default covers
``router``); rollout correction is needed even for BF16 MoE (paper), so keep TIS on. Needs
several nodes: see qwen3_30b_a3b_multihost.py and docs/SCALING.md.
"""

from experiments.configs import hf_base


def get_config():
    c = hf_base.get_config()
    c.trainer.run_dir = "runs/qwen3_30b_a3b"
    return c
