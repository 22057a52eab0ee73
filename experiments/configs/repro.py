"""Arms of the miniature reproduction of the FP8-RL paper (issue 8): ``experiments/repro_fp8rl.py``.

Parent: tiny.py (itself base.py). Pass the arm after a colon, e.g.
``--config=experiments/configs/repro.py:fp8_tis``. Every arm trains the same tiny policy on the
same task (2-digit addition, ``task.seed`` fixed); the sweep varies only ``trainer.seed`` (model
init, SFT, sampling). Arms (paper experiment in brackets):
  bf16_none     BF16 rollout, no correction                            [E1 baseline]
  fp8_none      FP8 W8A8 (E4M3, 128x128 / 1x128), no correction        [E1 "without TIS"]
  fp8_tis       FP8 W8A8 + token TIS, C=2                              [E1, the recipe]
  fp8_mis       FP8 W8A8 + token MIS (mask ratios outside [1/2, 2])   [limitations: MIS]
  fp8kv_tis     FP8 W8A8 + FP8 E4M3 KV cache (static, per-step recalibrated) + token TIS  [E3]
  harsh_none    E5M2 per-tensor weights/activations + FP8 KV cache, no correction
  harsh_tis     the same + token TIS                                   [harsher quantization]
  moe_bf16_none tiny Qwen3-MoE (4 experts, top-2), BF16 rollout        [E2]
  moe_fp8_tis   tiny Qwen3-MoE, FP8 W8A8 + token TIS                   [E2]
"harsh" = tiny.py's e5m2 arm plus the FP8 KV cache: E5M2 keeps 2 mantissa bits (vs 3 for E4M3)
and one scale per weight matrix; the FP8 KV cache adds its own error on top.
Run length (RL steps, eval cadence) is set here once for the whole sweep.
"""

from experiments.configs import tiny

# arm -> (tiny.py arm, MoE model?, FP8 KV cache on top of the tiny.py arm?)
ARMS = {
    "bf16_none": ("bf16_none", False, False),
    "fp8_none": ("fp8_none", False, False),
    "fp8_tis": ("fp8_tis", False, False),
    "fp8_mis": ("fp8_mis", False, False),
    "fp8kv_tis": ("fp8kv_tis", False, False),
    "harsh_none": ("e5m2_none", False, True),
    "harsh_tis": ("e5m2_tis", False, True),
    "moe_bf16_none": ("bf16_none", True, False),
    "moe_fp8_tis": ("fp8_tis", True, False),
}

RL_STEPS = 150  # per run: 40-110 s each (SFT, compiles, evals included) on 2 shared CPU cores
EVAL_EVERY = 25
EVAL_SIZE = 256


def get_config(arm: str = "fp8_tis"):
    if arm not in ARMS:
        raise ValueError(f"repro.py arm {arm!r}: expected one of {tuple(ARMS)}")
    tiny_arm, moe, fp8_kv = ARMS[arm]
    c = tiny.get_config(tiny_arm)
    if moe:
        c.model.architecture = "Qwen3MoeForCausalLM"
        c.model.num_experts = 4
    if fp8_kv:
        c.rollout.kv_cache_dtype = "float8_e4m3fn"
    return sweep_trainer(c, f"runs/repro_{arm}", RL_STEPS, EVAL_EVERY, EVAL_SIZE)


def sweep_trainer(c, run_dir: str, steps: int, eval_every: int, eval_size: int):
    """A sweep run's trainer settings (repro.py, repro_long.py): ``c`` with them set."""
    c.trainer.run_dir = run_dir
    c.trainer.steps = steps
    c.trainer.eval_every = eval_every
    c.trainer.eval_size = eval_size
    c.trainer.checkpoint_every = 0  # the sweep resumes per run (summary.json), not mid-run
    c.trainer.keep_checkpoints = 1
    c.trainer.plots = False  # the sweep draws its own comparison plots
    return c
