"""Parent of the real-model configs: a local HF checkpoint trained with the paper's recipe.

Parent: base.py. Changes: ``model.hf_checkpoint`` and ``task.jsonl_path`` become required (pass
them on the command line); the task is JSONL math with the checkpoint's tokenizer and chat
template; no SFT; the FP8-RL paper's recipe (arXiv 2601.18150, DESIGN.md §4.7): FP8 W8A8 rollout
with 128x128 blocks, FP8 E4M3 KV cache with per-step recalibrated static scales, token TIS C=2,
GRPO, clip 0.2/0.28, lr 1e-6, weight decay 0.1, grad clip 1.0, no KL, token-mean, one update per
rollout, 32 prompts x 16 responses, temperature 1.0, BF16 compute.
"""

from ml_collections import config_dict

from experiments.configs import base


def get_config():
    c = base.get_config()
    c.model.hf_checkpoint = config_dict.placeholder(str)  # required: local HF checkpoint dir
    c.task.name = "math"
    c.task.jsonl_path = config_dict.placeholder(str)  # required: local JSONL (question, answer)
    c.task.tokenizer_path = ""  # "" = the checkpoint's own tokenizer
    c.task.format_reward = 0.0
    c.sft.steps = 0  # pretrained models need no warm start

    c.rollout.max_new_tokens = 8192  # the paper uses 20480; raise it where memory allows
    c.rollout.stop_token_ids = (151645, 151643)  # Qwen: <|im_end|>, <|endoftext|>
    c.rollout.kv_cache_dtype = "float8_e4m3fn"
    c.rollout.kv_scale_mode = "static"
    c.rollout.compute_dtype = "bfloat16"

    c.rl.group_size = 16
    c.rl.num_minibatches = 1  # one update per rollout isolates the quantization effect
    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.optim.b2 = 0.999

    c.trainer.steps = 500
    c.trainer.prompts_per_step = 32
    c.trainer.eval_every = 5  # the paper's test_freq
    c.trainer.eval_size = 512
    c.trainer.checkpoint_every = 20
    return c
