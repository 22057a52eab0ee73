"""Base config: every field of an experiment with its default (a tiny CPU GRPO run).

Parent of every other config. Defaults: a 2-layer Qwen3-style model (D=64) on 2-digit addition,
SFT warm start, FP8 W8A8 rollouts (E4M3, 128x128 weight blocks, 1x128 activation groups), BF16
KV cache, token-level TIS (C=2), GRPO with clip-higher, 32 prompts x 16 responses per step and
4 minibatch updates per rollout. On 2 CPU cores: ~20 s SFT, ~0.4 s per RL step.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()

    c.model = m = config_dict.ConfigDict()
    m.hf_checkpoint = ""  # local HF checkpoint dir; "" = tiny random model below
    m.architecture = "Qwen3ForCausalLM"  # tiny model: HF architecture it mimics
    m.hidden_size = 64  # D
    m.num_layers = 2  # L
    m.num_heads = 4  # H
    m.num_kv_heads = 2  # K (GQA)
    m.head_dim = 16  # C
    m.intermediate_size = 256  # F
    m.num_experts = 0  # E; > 0 makes an MoE model
    m.num_experts_per_tok = 2  # MoE top-k
    m.moe_intermediate_size = 64  # F per expert
    m.tie_word_embeddings = True
    m.max_position_embeddings = 512

    c.task = t = config_dict.ConfigDict()
    t.name = "addition"  # addition | multiplication | countdown | reverse | sort | math
    t.digits = 2  # operand digits (arithmetic tasks)
    t.seed = 0  # problem generator seed
    t.format_reward = 0.0  # reward for a well-formed wrong answer
    t.jsonl_path = ""  # math: local JSONL file
    t.eval_jsonl_path = ""  # math: held-out JSONL; "" = hold out eval_fraction of jsonl_path
    t.eval_fraction = 0.1
    t.question_key = "question"  # math: JSONL field names
    t.answer_key = "answer"
    t.tokenizer_path = ""  # HF tokenizer dir; "" = character tokenizer

    c.sft = s = config_dict.ConfigDict()
    s.steps = 300  # supervised warm-start updates (0 = none); ~20% held-out accuracy after
    s.batch_size = 64  # demonstrations per update
    s.compute_dtype = "float32"
    s.optim = config_dict.ConfigDict(
        dict(
            lr=3e-3,
            weight_decay=0.0,
            grad_clip=1.0,
            b1=0.9,
            b2=0.99,
            eps=1e-8,
            warmup_steps=20,
            schedule="constant",
            decay_steps=0,
            end_lr_frac=0.0,
        )
    )

    c.rollout = r = config_dict.ConfigDict()
    r.max_new_tokens = 6  # response budget (tokens)
    r.stop_token_ids = (2,)  # EOS of the character tokenizer
    r.kv_cache_dtype = "bfloat16"  # bfloat16 | float32 | float8_e4m3fn
    r.kv_scale_mode = "static"  # FP8 KV: static (recalibrated every step) | dynamic
    r.compute_dtype = "bfloat16"  # rollout activations and the scoring (pi_old) pass
    r.kv_calib_percentile = 99.9
    r.kv_calib_margin = 1.05
    # Kernel choices: "auto" (the Pallas kernel where its support check passes, else XLA) |
    # "xla" | "pallas_mosaic_gpu" | "pallas_tpu". decode_attention_impl None: jnp attention.
    r.matmul_impl = "auto"  # W8A8 linear layers
    r.decode_attention_impl = config_dict.placeholder(str)
    r.sampling = config_dict.ConfigDict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    r.quant = q = config_dict.ConfigDict()
    q.enabled = True  # False = BF16 rollout weights
    q.dtype = "float8_e4m3fn"  # float8_e4m3fn | float8_e5m2
    q.weight_block = (128, 128)  # [in, out] weight block per scale
    q.act_group = 128  # per-token activation group (must equal weight_block[0])
    q.pow2_scales = False  # UE8M0 power-of-two scales
    q.per_tensor = False  # one scale per weight matrix (harsh ablation)
    q.keep_first_n = 0  # first N layers stay BF16
    q.keep_last_n = 0  # last N layers stay BF16

    c.rl = rl = config_dict.ConfigDict()
    rl.group_size = 16  # responses per prompt
    rl.advantage = "grpo"  # grpo | drgrpo | rloo | gae (PPO with a value head on the policy)
    rl.ppo_epochs = 1
    rl.num_minibatches = 4  # updates per rollout (paper: 1; 4 learns faster at this size)
    rl.grad_accum = 1
    rl.gamma = 1.0  # GAE discount per token (advantage=gae)
    rl.lam = 1.0  # GAE lambda (advantage=gae)
    rl.whiten_advantages = True  # GAE: whiten advantages over the batch's response tokens
    rl.kl_in_reward = 0.0  # beta of the per-token reward penalty -beta*KL(pi_old||pi_ref); 0: off
    rl.loss = config_dict.ConfigDict(
        dict(
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=3.0,
            agg="token-mean",
            kl_coef=0.0,
            kl_kind="k3",
            entropy_coef=0.0,
            vf_coef=0.5,
            vf_clip=0.5,
        )
    )
    rl.correction = config_dict.ConfigDict(
        dict(
            is_level="token",
            is_threshold=2.0,
            rs_level=None,
            rs_upper=2.0,
            rs_lower=None,
            rs_veto_threshold=None,
            icepop=False,
            icepop_low=0.5,
            icepop_high=5.0,
            batch_normalize=False,
            bypass=False,
        )
    )
    # Fields that may be None must have a type for command-line overrides.
    rl.correction.is_level = config_dict.placeholder(str)
    rl.correction.is_level = "token"
    rl.correction.rs_level = config_dict.placeholder(str)
    rl.correction.rs_lower = config_dict.placeholder(float)
    rl.correction.rs_veto_threshold = config_dict.placeholder(float)

    c.optim = o = config_dict.ConfigDict()
    o.lr = 3e-4  # tiny models learn at a far larger lr than the paper's 1e-6 for 8B
    o.weight_decay = 0.0
    o.grad_clip = 1.0
    o.b1 = 0.9
    o.b2 = 0.99
    o.eps = 1e-8
    o.warmup_steps = 0
    o.schedule = "constant"
    o.decay_steps = 0
    o.end_lr_frac = 0.0

    c.trainer = tr = config_dict.ConfigDict()
    tr.run_dir = "runs/base"  # all outputs of the run
    tr.seed = 0
    tr.steps = 300  # RL steps
    tr.prompts_per_step = 32  # x group_size responses per step
    tr.eval_every = 50
    tr.eval_size = 256
    tr.checkpoint_every = 50
    tr.keep_checkpoints = 3
    tr.max_nonfinite_skips = 5
    tr.plots = True

    # Device mesh (docs/SCALING.md): one device by default; -1 = all remaining devices.
    c.mesh = config_dict.ConfigDict(dict(data=1, fsdp=-1, expert=1, tensor=1))
    # jax.distributed: empty fields come from JAX_* / SLURM environment variables.
    c.distributed = config_dict.ConfigDict(
        dict(coordinator_address="", num_processes=0, process_id=-1, local_device_ids=(),
             cpu_collectives="gloo", initialization_timeout_s=300)
    )  # fmt: skip
    return c
