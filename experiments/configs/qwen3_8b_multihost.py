"""Qwen3-8B GRPO with FP8 rollouts on several 8xH100 nodes (the paper's dense setting).

Parent: qwen3_8b.py (hf_base.py's paper recipe: FP8 W8A8 + FP8 KV cache with per-step
recalibrated static scales, token TIS C=2, lr 1e-6, one update per rollout). Changes: the
``mesh`` (docs/SCALING.md; ``distributed`` fields come from the environment that
experiments/launch/*.sh set), a run_dir for a shared file system, no plots (headless nodes), and
``rl.grad_accum = 16`` so a loss micro-batch has a row for each of the 32 GPUs.

Mesh: data = number of nodes (-1), fsdp = 8 GPUs of a node. Training state 16 B/param = 122 GiB,
15.3 GiB per GPU; FP8 rollout weights 8.8 GiB, replicated per GPU; KV cache FP8 72 KiB/token.

Launch: sbatch --nodes=4 experiments/launch/slurm_h100.sbatch \
            --config=experiments/configs/qwen3_8b_multihost.py \
            --config.model.hf_checkpoint=/shared/Qwen3-8B-Base \
            --config.task.jsonl_path=/shared/math.jsonl
"""

from experiments.configs import qwen3_8b


def get_config():
    c = qwen3_8b.get_config()
    c.trainer.run_dir = "runs/qwen3_8b_multihost"  # on a shared file system (orbax shards)
    c.trainer.plots = False
    c.mesh.update(dict(data=-1, fsdp=8, expert=1, tensor=1))  # nodes x 8 GPUs
    # 512 rows in micro-batches of 32: one row per GPU on 4 nodes (hf_base's 32 micro-batches of
    # 16 rows would split over the 4 nodes only, each row computed on 8 GPUs; train.checks warns)
    c.rl.grad_accum = 16
    return c
