"""Qwen3-30B-A3B (MoE, 128 experts, top-8) GRPO with FP8 rollouts on several 8xH100 nodes.

Parent: qwen3_8b_multihost.py. Changes: the MoE checkpoint (pass its path), and a mesh with
expert parallelism inside a node (expert = 8) and FSDP across nodes (fsdp = -1, the number of
nodes): in training every weight shards over fsdp x expert (experts on their E axis, the rest
FSDP-style).
On 4 nodes: training state 16 B/param = 455 GiB, 14.2 GiB per GPU; FP8 rollout experts 3.4 GiB
per GPU plus 2.0 GiB of replicated non-expert weights; KV cache FP8 48 KiB/token.

Launch: sbatch --nodes=4 experiments/launch/slurm_h100.sbatch \
            --config=experiments/configs/qwen3_30b_a3b_multihost.py \
            --config.model.hf_checkpoint=/shared/Qwen3-30B-A3B-Base --config.task.jsonl_path=...
"""

from experiments.configs import qwen3_8b_multihost as parent


def get_config():
    c = parent.get_config()
    c.trainer.run_dir = "runs/qwen3_30b_a3b_multihost"
    c.mesh.update(dict(data=1, fsdp=-1, expert=8, tensor=1))
    return c
