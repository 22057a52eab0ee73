"""Parent of the real-model configs: a local HF checkpoint trained with the paper's recipe.

Parent: base.py. Changes: ``model.hf_checkpoint`` and ``task.jsonl_path`` become required (pass
them on the command line); the task is math from a veRL-layout file (parquet or JSONL:
``prompt`` chat messages, ``reward_model.ground_truth``, ``data_source``, ``extra_info``; the
layout of DAPO-Math-17k) with the checkpoint's tokenizer and chat template, rewarded by HF
math-verify (1 / 0; needs ``pip install 'fp8rl_jax[math]'``); stop tokens from the checkpoint's
generation_config.json and tokenizer; no SFT; W&B logging beside JSONL and TensorBoard (needs
``pip install 'fp8rl_jax[wandb]'``; ``WANDB_MODE=offline`` writes locally). The FP8-RL paper's
DAPO recipe (arXiv 2601.18150; veRL's FP8 recipes, reference/fp8rl_paper_and_verl.md §c): FP8
W8A8 rollout with 128x128 blocks, FP8 E4M3 KV cache with per-step recalibrated static scales,
token TIS C=2, GRPO, clip 0.2/0.28 and dual clip 10, lr 1e-6, weight decay 0.1, grad clip 1.0,
no KL, token-mean, one update per rollout, 32 prompts x 16 responses, temperature 1.0, BF16
compute; DAPO dynamic sampling (veRL: generation batches of 96 prompts, at most 10 per step;
here 32 prompts, at most 30: the same budget in a third of the rollout memory) and overlong
shaping over the last 512 tokens (penalty factor 1.0, no overlong filtering). Memory knobs that
change no value: log-probs from 512-token chunks of logits, scoring in 64-row micro-batches,
block rematerialization in the loss, 32 accumulated micro-batches per update, and the paged
rollout engine with a 16 GiB KV page pool per device (``experiments/plan.py`` shows what fits).
"""

from ml_collections import config_dict

from experiments.configs import base


def get_config():
    c = base.get_config()
    c.model.hf_checkpoint = config_dict.placeholder(str)  # required: local HF checkpoint dir
    c.task.name = "math"
    c.task.jsonl_path = config_dict.placeholder(str)  # required: parquet or JSONL, veRL layout
    c.task.question_key = "prompt"  # veRL: a list of chat messages
    c.task.answer_key = "reward_model.ground_truth"
    c.task.data_source_key = "data_source"
    c.task.extra_info_key = "extra_info"
    c.task.verifier = "math_verify"
    c.task.tokenizer_path = ""  # "" = the checkpoint's own tokenizer
    c.task.format_reward = 0.0
    c.sft.steps = 0  # pretrained models need no warm start

    c.rollout.max_new_tokens = 8192  # the paper's 20,480: qwen3_8b_20k.py
    c.rollout.stop_token_ids = ()  # () = the checkpoint's generation_config.json + tokenizer EOS

    c.rl.dapo.dynamic_sampling = True  # veRL algorithm.filter_groups (metric: acc)
    # veRL's recipe: generation batches of 96 prompts (3x the train batch), at most 10 per step.
    # Here 32 x at most 30: the same prompt budget, at a third of the rollout memory (the static
    # engine holds a dense KV cache for every row of a generation batch).
    c.rl.dapo.gen_prompts = 32
    c.rl.dapo.max_num_gen_batches = 30
    c.rl.dapo.overlong_buffer = 512  # veRL overlong_buffer.len
    c.rl.dapo.overlong_penalty_factor = 1.0
    c.rl.loss.dual_clip = 10.0  # veRL clip_ratio_c of the FP8 recipes
    c.rollout.kv_cache_dtype = "float8_e4m3fn"
    c.rollout.kv_scale_mode = "static"
    c.rollout.compute_dtype = "bfloat16"
    # Rollout KV memory follows the tokens (issue 20): the paged engine, one engine and page pool
    # per batch shard, the pool sized from a per-device budget (experiments/plan.py checks it).
    c.rollout.engine = "paged"
    # tokens per page = the H100 paged kernel's tile; 128 also compiles (FP8 pages: swap-AB with
    # query groups <= 16), one CTA per SM: set it where the device measures it faster
    c.rollout.paged.page_size = 64
    c.rollout.paged.kv_memory_bytes = 16 * 2**30  # per device: 233K FP8 tokens of Qwen3-8B

    c.rl.group_size = 16
    # Memory (issue 20): no [rows, T, V] f32 logits (V = 151,936: 0.6 MB per token), scoring in
    # row micro-batches, each block recomputed in the loss backward. None changes a value.
    c.rl.logprob_chunk = 512  # tokens per lm-head chunk: [rows, 512, V] f32 logits at a time
    c.rl.score_micro_batch = 64  # rows per scoring forward (8 per device at fsdp=8)
    c.rl.remat = "block"  # keep only each block's input for the backward pass
    c.rl.num_minibatches = 1  # one update per rollout isolates the quantization effect
    c.rl.grad_accum = 32  # 512-row minibatch in micro-batches of 16 rows (2 per device at 8)
    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.optim.b2 = 0.999

    c.trainer.steps = 500
    c.trainer.prompts_per_step = 32
    c.trainer.eval_every = 5  # the paper's test_freq
    c.trainer.eval_size = 512
    c.trainer.checkpoint_every = 20
    c.trainer.loggers = ("jsonl", "tensorboard", "wandb")
    c.trainer.allow_cpu = False  # meant for GPUs/TPUs: a CPU-only jax stops with one line
    return c
