"""Qwen3-30B-A3B(-Base) MoE: the paper's MoE experiment (E2), router kept high precision, on one
node of 8 x H100 (or H200).

Parent: hf_base.py. Changes: run_dir; the MoE router stays BF16 (quant.exclude default covers
``router``); rollout correction is needed even for BF16 MoE (paper), so keep TIS on; experts
split over the GPUs of the node (mesh expert = 8), the rest FSDP over the same devices.

Memory on 8 x H100 (``experiments/plan.py --topology=8xh100``; the table is in the README):
f32 params and Adam moments are 12 B/param = 42.7 GiB per GPU, the f32 gradients and their
accumulator another ~14 each, which leaves too little of 80 GB for the activations. So Adam's
first moment is kept in BF16 (``optim.mu_dtype``: 7.1 GiB less per GPU; the second moment
stays f32, see ``OptimConfig``) and the 512-row minibatch is accumulated in 64 micro-batches of
one row per GPU: the train program then needs 64.2 GiB per GPU compiled at all 48 layers
(62.2 from 8,16) of the 71.2 allowed. With f32 mu it needs 71.3 compiled at all 48 layers
(68.7 extrapolated): 0.1 over. The paged KV pool is 12 GiB per GPU (262K tokens of this
model; Qwen3-8B's 16 GiB hold 233K). On 8 x H200 (``--topology=8xh200``)
``--config.optim.mu_dtype=float32 --config.rl.grad_accum=32`` also fits (the paper's f32
state); across 4 nodes of H100s use qwen3_30b_a3b_multihost.py.

Speed on GPUs: the BF16 experts (the scoring pass and training) run ``grouped_matmul``'s Hopper
kernels, forward and backward, which compute only the dispatch buffer's live rows; XLA:GPU's own
``ragged_dot`` would compute every row times every local expert (~128x the useful FLOPs here:
docs/SCALING.md §4b). Predicted, not measured: ~105 s per step in the experts instead of ~37 min.
"""

from experiments.configs import hf_base


def get_config():
    c = hf_base.get_config()
    c.trainer.run_dir = "runs/qwen3_30b_a3b"
    c.mesh.update(dict(data=1, fsdp=-1, expert=8, tensor=1))  # experts over 8 GPUs of a node
    c.optim.mu_dtype = "bfloat16"  # 7.1 GiB per GPU less on 8 (f32 nu: see OptimConfig)
    c.rl.grad_accum = 64  # 512 rows in micro-batches of 8: one row per GPU at a time
    # 48 KiB of FP8 K+V per token (48 layers x 4 KV heads): 12 GiB holds 262K tokens per GPU
    # (hf_base's 16 GiB: eval needed 71.3 GiB per GPU, over the 71.2 allowed on an H100).
    c.rollout.paged.kv_memory_bytes = 12 * 2**30
    return c
