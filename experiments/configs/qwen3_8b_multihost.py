"""Qwen3-8B GRPO with FP8 rollouts on several 8xH100 nodes (the paper's dense setting).

Parent: qwen3_8b.py (hf_base.py's paper recipe: FP8 W8A8 + FP8 KV cache with per-step
recalibrated static scales, token TIS C=2, lr 1e-6, one update per rollout). Changes: two new
sections, ``mesh`` (device mesh, docs/SCALING.md) and ``distributed`` (jax.distributed; empty
fields come from the environment that experiments/launch/*.sh set), a run_dir for a shared file
system, and no plots (headless nodes).

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
    c.mesh = mesh(data=-1, fsdp=8, expert=1, tensor=1)
    c.distributed = distributed()
    return c


def mesh(**sizes):
    """The ``mesh`` section: fp8rl_jax.train.sharding.MeshConfig fields."""
    from ml_collections import config_dict

    m = config_dict.ConfigDict()
    m.data = sizes["data"]  # data-parallel replicas (across nodes); -1 = the rest
    m.fsdp = sizes["fsdp"]  # FSDP shards of weights + optimizer state (within a node)
    m.expert = sizes["expert"]  # expert-parallel shards (MoE)
    m.tensor = sizes["tensor"]  # tensor-parallel shards (heads, MLP hidden, vocab)
    return m


def distributed():
    """The ``distributed`` section: fp8rl_jax.train.distributed.DistributedConfig fields."""
    from ml_collections import config_dict

    d = config_dict.ConfigDict()
    d.coordinator_address = ""  # "host:port"; "" = JAX_COORDINATOR_ADDRESS or SLURM
    d.num_processes = 0  # 0 = JAX_NUM_PROCESSES or SLURM_NTASKS
    d.process_id = -1  # -1 = JAX_PROCESS_ID or SLURM_PROCID
    d.local_device_ids = ()  # () = all GPUs visible to the process
    d.cpu_collectives = "gloo"  # CPU-only runs
    d.initialization_timeout_s = 300  # wait for all processes (s)
    return d
