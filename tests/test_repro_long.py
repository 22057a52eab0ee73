"""The long-response sweep (experiments/repro_long.py): arms, length profiles, a quick smoke run."""

import json
import math
import os
import pathlib

import numpy as np
import pytest

from experiments import repro_long
from experiments.configs import repro_long as arms


def test_arms_config():
    c = arms.get_config("fp8train_none")
    assert c.rl.train_precision == "fp8_rollout" and c.rl.correction.is_level is None
    assert c.rollout.quant.enabled and c.rollout.engine == arms.ENGINE
    assert c.task.name == "chain" and c.task.max_steps == arms.MAX_STEPS
    assert c.rollout.max_new_tokens == 4 * arms.MAX_STEPS  # longest chain (4 n - 1) + EOS
    assert arms.get_config("fp8_tis").rl.correction.is_level == "token"
    assert arms.get_config("fp8_mis").rl.correction.rs_level == "token"
    assert arms.get_config("fp8_none").rl.train_precision == "bf16"
    assert not arms.get_config("bf16_none").rollout.quant.enabled
    assert (c.optim.lr, c.rl.num_minibatches, c.sft.steps) == (arms.LR, 1, arms.SFT_STEPS)
    with pytest.raises(ValueError, match="expected one of"):
        arms.get_config("fp4_tis")


def test_length_profile_weights_steps_by_counts():
    rows = [
        {"step": 1, "kl_pos0": 0.1, "tokens_pos0": 30.0, "kl_pos32": 0.0, "tokens_pos32": 0.0},
        {"step": 2, "kl_pos0": 0.4, "tokens_pos0": 10.0, "kl_pos32": 0.5, "tokens_pos32": 4.0},
    ]
    prof = repro_long.length_profile(rows, "kl_pos", "tokens_pos")
    assert prof.keys() == {0, 32}
    assert math.isclose(prof[0], (30 * 0.1 + 10 * 0.4) / 40)
    assert math.isclose(prof[32], 0.5)  # the empty bucket of step 1 does not count


def test_sft_cache_reuses_identical_warm_starts():
    cache = repro_long.SFTCache()
    batch = lambda i: (np.arange(3) + i,)  # noqa: E731
    k = cache.key({"w": np.ones(2)}, "model", "sft", batch)
    assert k == cache.key({"w": np.ones(2)}, "model", "sft", batch)
    assert k != cache.key({"w": np.zeros(2)}, "model", "sft", batch)
    assert k != cache.key({"w": np.ones(2)}, "model", "sft2", batch)
    assert k != cache.key({"w": np.ones(2)}, "model", "sft", lambda i: (np.arange(3) + 1,))


@pytest.mark.slow
def test_quick_sweep_writes_report_with_length_curves(tmp_path):
    out = str(tmp_path / "repro_long")
    assert repro_long.main(["--quick", f"--out={out}"]) == 0
    report = pathlib.Path(out, "REPORT.md").read_text()
    for arm in repro_long.QUICK_ARMS:
        rd = repro_long.run_dir(out, arm, 0)
        assert os.path.exists(os.path.join(rd, "summary.json"))
        assert not os.path.exists(os.path.join(rd, "config.1.json"))  # one config, the trainer's
        assert f"| {arm} | 1 |" in report
    assert "Missing runs" not in report and "## Mismatch vs response length" in report
    assert "## Held-out mean reward" in report
    names = ("accuracy.png", "mismatch_kl.png", "kl_vs_position.png", "kl_vs_length.png")
    for name in (*names, "eval_reward.png"):
        assert os.path.exists(os.path.join(out, name)), name
    stats = json.loads(pathlib.Path(out, "summary.json").read_text())
    assert stats["fp8_none"]["kl"][0] > stats["bf16_none"]["kl"][0]  # FP8 rollouts mismatch more
    rows = repro_long.read_run_metrics(repro_long.run_dir(out, "fp8_none", 0))
    prof = repro_long.length_profile(rows, "kl_pos", "tokens_pos")
    assert set(prof) <= {0, 32} and 0 in prof  # responses of up to 40 tokens
