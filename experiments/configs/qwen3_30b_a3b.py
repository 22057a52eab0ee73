"""Qwen3-30B-A3B(-Base) MoE: the paper's MoE experiment (E2), router kept high precision.

Parent: hf_base.py. Changes: run_dir; the MoE router stays BF16 (quant.exclude default covers
``router``); rollout correction is needed even for BF16 MoE (paper), so keep TIS on; experts
split over the GPUs of the node (mesh expert = 8), the rest FSDP over the same devices. The
training state alone is 16 B/param = 455 GiB (57 GiB per GPU on 8), so one node means 8 x H200
(``experiments/plan.py --topology=8xh200``); on H100s use qwen3_30b_a3b_multihost.py (4 nodes).
"""

from experiments.configs import hf_base


def get_config():
    c = hf_base.get_config()
    c.trainer.run_dir = "runs/qwen3_30b_a3b"
    c.mesh.update(dict(data=1, fsdp=-1, expert=8, tensor=1))  # experts over 8 GPUs of a node
    return c
