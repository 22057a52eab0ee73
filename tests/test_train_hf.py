"""The real-model path end to end on a tiny HF checkpoint: qwen3_8b.py's DAPO recipe (FP8 W8A8,
FP8 KV cache with recalibrated static scales, token TIS, dynamic sampling, overlong shaping) on a
veRL-layout parquet fixture (chat prompts through the tokenizer's template), math-verify rewards,
stop tokens from the checkpoint; then the FP8 export of the trained policy round-trips.

One run (``test_dapo_recipe_trains_on_nonzero_math_verify_rewards``) checks all of it: a second
run on tests/fixtures/verl (a tokenizer that cannot write a digit, so all-zero rewards) repeated
the same path and programs (tests/test_tasks_datasets.py reads that parquet)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"


def _check_fp8_export(flags, tmp_path):
    """The trained policy exported in block FP8 reloads to the rollout's logits exactly."""
    from experiments.configs import qwen3_8b
    from experiments.configs.defaults import set_path
    from fp8rl_jax.generation import rollout_weights
    from fp8rl_jax.models import forward, load_fp8_checkpoint, load_hf_checkpoint
    from fp8rl_jax.train.experiment import experiment_from_config
    from fp8rl_jax.train.export import export_hf

    config = qwen3_8b.get_config()
    literal = {"trainer.loggers": ("jsonl",), "rollout.quant.weight_block": (32, 32)}
    for k, v in flags.items():
        set_path(config, k, literal[k] if k in literal else str(v) if isinstance(v, Path) else v)
    exp = experiment_from_config(config)
    assert export_hf(exp, str(tmp_path / "bf16"), fmt="bf16") == 2
    assert export_hf(exp, str(tmp_path / "fp8"), fmt="fp8") == 2
    cfg, trained = load_hf_checkpoint(tmp_path / "bf16", dtype=jnp.float32)
    in_memory, _ = rollout_weights(trained, exp.rollout)  # what the rollout runs
    cfg8, loaded = load_fp8_checkpoint(tmp_path / "fp8")
    assert cfg8 == cfg
    tokens = jnp.array([[1, 5, 9, 17, 33, 60, 2, 7]], jnp.int32)
    logits = jax.jit(lambda w, c=cfg: forward(w, tokens, c).logits_BTV)
    np.testing.assert_array_equal(np.asarray(logits(loaded)), np.asarray(logits(in_memory)))
    quant = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [32, 32] and quant["activation_scheme"] == "dynamic"


def test_real_model_config_requires_a_checkpoint_path():
    argv = [sys.executable, "experiments/train.py", "--config=experiments/configs/qwen3_8b.py"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "config.model.hf_checkpoint is required" in proc.stderr


DIGITS = FIX / "math_digits"  # a tokenizer with digits, a tiny checkpoint, one-digit sums
DIGITS_FLAGS = {
    "model.hf_checkpoint": DIGITS,
    "task.jsonl_path": DIGITS / "sums.parquet",
    "task.eval_fraction": 0.25,
    "task.tokenizer_path": DIGITS,  # named apart from the checkpoint (here the same files)
    "rollout.max_new_tokens": 6,  # \boxed{7} is 5 tokens, then <|im_end|>
    "rl.dapo.overlong_buffer": 2,
    "rl.dapo.gen_prompts": 4,
    "rl.dapo.max_num_gen_batches": 2,
    "trainer.steps": 2,
    "trainer.prompts_per_step": 2,
    "rl.group_size": 4,
    "trainer.eval_size": 4,
    "trainer.loggers": "('jsonl',)",
    "trainer.allow_cpu": True,
    "rollout.quant.weight_block": "(32, 32)",
    "rollout.quant.act_group": 32,
    # hf_base's scale settings, sized down: 2 accumulated micro-batches, an 8 MiB page pool
    "rl.grad_accum": 2,
    "rollout.paged.kv_memory_bytes": 8 * 2**20,
    # the answer format and some sums (loss 6.1 -> 0.7): rewards neither all 0 nor all 1 (150
    # steps: every sum right, every group filtered)
    "sft.steps": 14,
    "sft.batch_size": 16,
}


@pytest.mark.slow
def test_dapo_recipe_trains_on_nonzero_math_verify_rewards_and_exports_fp8(tmp_path):
    """The DAPO path on data it can solve: math-verify rewards 1 and 0, groups kept and filtered,
    slots left empty masked out, and an update that moves the policy; its logged KV scales and
    counts, its config, and the FP8 export of the trained policy."""
    run_dir = tmp_path / "run"
    flags = {**DIGITS_FLAGS, "trainer.run_dir": run_dir}
    argv = [sys.executable, "experiments/train.py", "--config=experiments/configs/qwen3_8b.py"]
    argv += [f"--config.{k}={v}" for k, v in flags.items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    all_rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in all_rows] == [0, 1, 2]
    rows = all_rows[1:]
    assert max(r["reward_mean"] for r in rows) > 0  # math-verify said 1 somewhere
    assert sum(r["dapo_groups_kept"] for r in rows) > 0  # groups with mixed rewards
    assert sum(r["dapo_groups_filtered"] for r in rows) > 0  # groups all right or all wrong
    assert max(r["dapo_unfilled_frac"] for r in rows) > 0  # a step with slots left empty
    for r in rows:
        assert r["dapo_unfilled_frac"] == 1 - r["dapo_groups_kept"] / 2  # empty slots masked
        if r["dapo_groups_kept"]:
            assert r["grad_norm"] > 0 and r["advantage_abs_mean"] > 0 and r["loss"] != 0
        assert all(math.isfinite(r[k]) for k in ("kl", "loss", "grad_norm", "is_weight_mean"))
        assert r["quant_nonfinite"] == 0 and r["nonfinite_skips"] == 0
        # the recalibrated static FP8 KV scales are logged, finite and positive, none invalid
        assert 0 < r["kv_scale_k_min"] <= r["kv_scale_k_max"] < math.inf
        assert 0 < r["kv_scale_v_min"] <= r["kv_scale_v_max"] < math.inf
        assert r["kv_scale_invalid"] == 0
        # DAPO: generation batches and group counts add up; eq. 13 penalty in [-1, 0]
        assert 1 <= r["dapo_gen_batches"] <= 2
        seen = DIGITS_FLAGS["rl.dapo.gen_prompts"] * r["dapo_gen_batches"]
        assert r["dapo_groups_kept"] + r["dapo_groups_filtered"] <= seen
        assert -1.0 <= r["overlong_penalty_mean"] <= 0.0 and 0 <= r["truncated_frac"] <= 1
    config = json.loads((run_dir / "config.json").read_text())
    assert config["rollout"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert config["rl"]["correction"]["is_level"] == "token"
    assert config["task"]["verifier"] == "math_verify"
    assert config["rl"]["dapo"]["dynamic_sampling"] is True
    assert "stop tokens from the checkpoint: (2,)" in proc.stdout  # <|im_end|>
    assert (run_dir / "summary.json").exists()
    _check_fp8_export(flags, tmp_path)
