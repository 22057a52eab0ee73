"""Qwen3-8B(-Base) on a TPU v6e-16 slice (16 chips of 32 GiB, 4 hosts): qwen3_8b's run on TPU.

Parent: qwen3_8b.py (hf_base.py's paper recipe). Changes: run_dir, the paged rollout engine's
pages and pool for a v6e chip, and scoring micro-batches of 32 rows (2 per chip). Pages of 128
tokens, the smallest block of the Mosaic TPU paged decode kernel
(``kernels_pallas/paged_attention/pallas_tpu.py``; the parent's 64 is the H100 kernel's tile,
which on TPU falls back to the XLA paged attention). A 4 GiB KV pool per chip (58K FP8 tokens of
Qwen3-8B) beside the 8.8 GB of replicated FP8 rollout weights. None changes a token or a
log-prob. ``experiments/plan.py --topology=v6e-16`` (experiments/results/
plan_qwen3_8b_v6e_v6e16.json): the rollout, train and eval programs fit 28.8 GiB per chip.
  python experiments/train.py --config=experiments/configs/qwen3_8b_v6e.py \\
      --config.model.hf_checkpoint=/data/Qwen3-8B-Base --config.task.jsonl_path=/data/dapo.jsonl
"""

from experiments.configs import qwen3_8b


def get_config():
    c = qwen3_8b.get_config()
    c.trainer.run_dir = "runs/qwen3_8b_v6e"
    c.rollout.paged.page_size = 128  # tokens per KV page: the TPU paged kernel's smallest block
    c.rollout.paged.kv_memory_bytes = 4 * 2**30  # per chip: 58K FP8 tokens of Qwen3-8B
    c.rl.score_micro_batch = 32  # rows per scoring forward: 2 per chip at fsdp=16
    return c
