"""Smoke check of the miniature-reproduction sweep (experiments/repro_fp8rl.py --quick)."""

import json
import os
import pathlib

import pytest

from experiments import repro_fp8rl
from experiments.configs import repro


def test_arms_config():
    c = repro.get_config("harsh_tis")
    assert c.rollout.quant.dtype == "float8_e5m2" and c.rollout.quant.per_tensor
    assert c.rollout.kv_cache_dtype == "float8_e4m3fn"
    assert c.rl.correction.is_level == "token"
    assert repro.get_config("fp8_none").rl.correction.is_level is None
    assert repro.get_config("fp8_mis").rl.correction.rs_level == "token"
    assert not repro.get_config("bf16_none").rollout.quant.enabled
    moe = repro.get_config("moe_fp8_tis")
    assert moe.model.num_experts == 4 and moe.model.architecture == "Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match="expected one of"):
        repro.get_config("fp4_tis")


@pytest.mark.slow
def test_quick_sweep_writes_report_and_resumes(tmp_path, capsys):
    out = str(tmp_path / "repro")
    assert repro_fp8rl.main(["--quick", f"--out={out}"]) == 0
    for arm in repro_fp8rl.QUICK_ARMS:
        rd = repro_fp8rl.run_dir(out, arm, 0)
        assert os.path.exists(os.path.join(rd, "summary.json"))
        assert not os.path.exists(os.path.join(rd, "checkpoints"))  # removed after the run
    report = pathlib.Path(out, "REPORT.md").read_text()
    for arm in repro_fp8rl.QUICK_ARMS:
        assert f"| {arm} | 1 |" in report
    assert "Missing runs" not in report
    assert os.path.exists(os.path.join(out, "accuracy.png"))
    assert os.path.exists(os.path.join(out, "mismatch_kl.png"))
    stats = json.loads(pathlib.Path(out, "summary.json").read_text())
    assert stats["fp8_tis"]["kl"][0] > stats["bf16_none"]["kl"][0]  # FP8 rollouts mismatch more

    # A hand-written reading survives regeneration, and finished runs are skipped.
    path = pathlib.Path(out, "REPORT.md")
    text = report.replace("(to be written)", "my reading")
    path.write_text(text)
    capsys.readouterr()
    assert repro_fp8rl.main(["--quick", f"--out={out}"]) == 0
    assert capsys.readouterr().out.count("done before, skipped") == 2
    assert "my reading" in path.read_text()
