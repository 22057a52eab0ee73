"""Qwen3-8B(-Base) on one 8xH100 node with the paper's 20,480-token responses (E1/E3 as run).

Parent: qwen3_8b.py. Changes: ``rollout.max_new_tokens`` 8,192 -> 20,480 (the paper's DAPO
recipe); half the rows per scoring forward (32) and per loss micro-batch (grad_accum 64: 8 rows,
1 per device), since a sequence is 2.5x longer; the run_dir. The paged engine's 16 GiB pool per
device holds 233K FP8 tokens, ~10 sequences at the full 22.5K (prompt + response); more run at
once while responses are shorter, and the engine preempts the youngest when the pool runs dry.
``python experiments/plan.py --config=experiments/configs/qwen3_8b_20k.py --topology=8xh100``.
"""

from experiments.configs import qwen3_8b


def get_config():
    c = qwen3_8b.get_config()
    c.trainer.run_dir = "runs/qwen3_8b_20k"
    c.rollout.max_new_tokens = 20480  # the paper's response budget
    c.rl.score_micro_batch = 32  # rows per scoring forward: 4 per device at fsdp=8
    c.rl.grad_accum = 64  # micro-batches of 8 rows (1 per device) per update
    return c
