"""The real-model path end to end on a tiny HF checkpoint: qwen3_8b.py's recipe (FP8 W8A8, FP8 KV
cache with recalibrated static scales, token TIS), JSONL math data, HF tokenizer + chat template."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"


def test_qwen3_config_trains_from_a_local_hf_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    flags = {
        "model.hf_checkpoint": FIX / "hf" / "qwen3",
        "task.jsonl_path": FIX / "data" / "math_tiny.jsonl",
        "task.eval_jsonl_path": FIX / "data" / "math_tiny_eval.jsonl",
        "task.tokenizer_path": FIX / "hf" / "tokenizer",
        "rollout.max_new_tokens": 8,
        "rollout.stop_token_ids": "(2,)",  # the fixture tokenizer's <|im_end|>
        "trainer.steps": 2,
        "trainer.prompts_per_step": 2,
        "rl.group_size": 2,
        "trainer.eval_size": 2,
        "trainer.run_dir": run_dir,
    }
    argv = [sys.executable, "experiments/train.py", "--config=experiments/configs/qwen3_8b.py"]
    argv += [f"--config.{k}={v}" for k, v in flags.items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert all(math.isfinite(r[k]) for k in ("kl", "loss", "grad_norm", "is_weight_mean"))
        assert r["quant_nonfinite"] == 0 and r["nonfinite_skips"] == 0
        # the recalibrated static FP8 KV scales are logged, finite and positive, none invalid
        assert 0 < r["kv_scale_k_min"] <= r["kv_scale_k_max"] < math.inf
        assert 0 < r["kv_scale_v_min"] <= r["kv_scale_v_max"] < math.inf
        assert r["kv_scale_invalid"] == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["rollout"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert config["rl"]["correction"]["is_level"] == "token"
    assert (run_dir / "summary.json").exists()


def test_real_model_config_requires_a_checkpoint_path():
    argv = [sys.executable, "experiments/train.py", "--config=experiments/configs/qwen3_8b.py"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "config.model.hf_checkpoint is required" in proc.stderr
