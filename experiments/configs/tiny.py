"""Tiny CPU arms of the paper's ablation: rollout precision x rollout correction.

Parent: base.py. Pass the arm after a colon, e.g. ``--config=experiments/configs/tiny.py:fp8_tis``.
Arm = ``<precision>_<correction>``:
  precision  bf16   -> rollout.quant.enabled=False (BF16 weights, BF16 KV cache)
             fp8    -> FP8 W8A8 (base default), BF16 KV cache
             fp8kv  -> FP8 W8A8 and FP8 (E4M3) KV cache with static per-step recalibrated scales
             e5m2   -> harsh arm: E5M2 weights/activations with per-tensor scales
  correction none   -> rl.correction.is_level=None
             tis    -> token TIS, C=2 (base default)
             mis    -> token MIS (masking ratios outside [1/2, 2]), no IS weights
run_dir becomes runs/tiny_<arm>.
"""

from experiments.configs import base

PRECISIONS = ("bf16", "fp8", "fp8kv", "e5m2")
CORRECTIONS = ("none", "tis", "mis")


def get_config(arm: str = "fp8_tis"):
    precision, _, correction = arm.partition("_")
    if precision not in PRECISIONS or correction not in CORRECTIONS:
        raise ValueError(
            f"tiny.py arm {arm!r}: expected <precision>_<correction> with precision in "
            f"{PRECISIONS} and correction in {CORRECTIONS}"
        )
    c = base.get_config()
    c.trainer.run_dir = f"runs/tiny_{arm}"
    if precision == "bf16":
        c.rollout.quant.enabled = False
    elif precision == "fp8kv":
        c.rollout.kv_cache_dtype = "float8_e4m3fn"
    elif precision == "e5m2":
        c.rollout.quant.dtype = "float8_e5m2"
        c.rollout.quant.per_tensor = True
    if correction == "none":
        c.rl.correction.is_level = None
    elif correction == "mis":
        c.rl.correction.is_level = None
        c.rl.correction.rs_level = "token"
        c.rl.correction.rs_upper = 2.0
    return c
