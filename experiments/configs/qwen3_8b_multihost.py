"""Qwen3-8B GRPO with FP8 rollouts on several 8xH100 nodes (the paper's dense setting).

Parent: base.py. Changes: a local Qwen3-8B HF checkpoint and its tokenizer on a JSONL math set,
no SFT, the paper's recipe (FP8 W8A8 + FP8 KV cache with per-step recalibrated static scales,
token TIS C=2, lr 1e-6, weight decay 0.1, one update per rollout), long responses, and two new
sections: ``mesh`` (device mesh, docs/SCALING.md) and ``distributed`` (jax.distributed; empty
fields come from the environment that experiments/launch/*.sh set).

Mesh: data = number of nodes (-1), fsdp = 8 GPUs of a node. Training state 16 B/param = 122 GiB,
15.3 GiB per GPU; FP8 rollout weights 8.8 GiB, replicated per GPU; KV cache FP8 72 KiB/token.

Launch: sbatch --nodes=4 experiments/launch/slurm_h100.sbatch \
            --config=experiments/configs/qwen3_8b_multihost.py
Needs the Experiment fields ``mesh`` and ``distributed`` (see docs/SCALING.md, "Trainer hooks").
"""

import os

from experiments.configs import base


def get_config():
    c = base.get_config()
    ckpt = os.environ.get("QWEN3_8B_DIR", "checkpoints/Qwen3-8B")
    c.model.hf_checkpoint = ckpt  # local HF dir: config.json + *.safetensors
    c.task.name = "math"
    c.task.jsonl_path = os.environ.get("MATH_JSONL", "data/math_train.jsonl")
    c.task.tokenizer_path = ckpt
    c.sft.steps = 0  # the pretrained model needs no warm start

    c.rollout.max_new_tokens = 8192  # response budget (tokens)
    c.rollout.stop_token_ids = (151645, 151643)  # <|im_end|>, <|endoftext|>
    c.rollout.kv_cache_dtype = "float8_e4m3fn"  # FP8 KV cache, static per-step scales
    c.rollout.sampling.temperature = 1.0

    c.rl.group_size = 16  # responses per prompt
    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.1
    c.optim.b2 = 0.999

    c.trainer.run_dir = "runs/qwen3_8b_multihost"  # on a shared file system (orbax shards)
    c.trainer.steps = 500
    c.trainer.prompts_per_step = 32  # x 16 = 512 sequences per step
    c.trainer.eval_every = 20
    c.trainer.eval_size = 512
    c.trainer.checkpoint_every = 20
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
