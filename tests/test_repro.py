"""The miniature-reproduction sweep (experiments/repro_fp8rl.py --quick): its arms, and its driver
(runs, report, resume) around a stand-in trainer."""

import json
import os
import pathlib

import pytest

from experiments import repro_fp8rl
from experiments.configs import repro
from fp8rl_jax.train import trainer


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


# Per arm: a stand-in run's held-out accuracy at steps 0 and 2, and its mismatch KL per step.
FAKE_RUNS = {"bf16_none": ((0.25, 0.5), (1e-4, 3e-4)), "fp8_tis": ((0.25, 0.375), (4e-3, 6e-3))}


def _fake_train(exp, progress=False):
    """Stands in for ``trainer.train`` (the sweep driver is under test here; the real trainer
    behind the same driver runs in tests/test_repro_long.py): writes what a finished 2-step run
    leaves in its run dir, with the numbers of FAKE_RUNS."""
    rd = pathlib.Path(exp.trainer.run_dir)
    arm = rd.parent.name
    (acc0, acc2), kls = FAKE_RUNS[arm]
    rows = [{"step": 0, "eval_accuracy": acc0}]
    rows += [{"step": t, "kl": kl, "rollout_time_s": 1.0} for t, kl in enumerate(kls, 1)]
    rows[-1]["eval_accuracy"] = acc2
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("checkpoints", "tensorboard"):
        (rd / name).mkdir()
    summary = {"steps": 2, "eval_accuracy_first": acc0, "eval_accuracy_last": acc2}
    (rd / "summary.json").write_text(json.dumps(summary))
    return summary


def test_quick_sweep_writes_report_and_resumes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trainer, "train", _fake_train)
    out = str(tmp_path / "repro")
    assert repro_fp8rl.main(["--quick", f"--out={out}"]) == 0
    for arm in repro_fp8rl.QUICK_ARMS:
        rd = repro_fp8rl.run_dir(out, arm, 0)
        assert os.path.exists(os.path.join(rd, "summary.json"))
        assert not os.path.exists(os.path.join(rd, "checkpoints"))  # removed after the run
        assert not os.path.exists(os.path.join(rd, "tensorboard"))
    report = pathlib.Path(out, "REPORT.md").read_text()
    for arm in repro_fp8rl.QUICK_ARMS:
        assert f"| {arm} | 1 |" in report
    assert "Missing runs" not in report
    assert os.path.exists(os.path.join(out, "accuracy.png"))
    assert os.path.exists(os.path.join(out, "mismatch_kl.png"))
    stats = json.loads(pathlib.Path(out, "summary.json").read_text())
    for arm, ((acc0, acc2), kls) in FAKE_RUNS.items():  # the runs' numbers, aggregated
        assert stats[arm]["kl"][0] == pytest.approx(sum(kls) / len(kls))
        assert (stats[arm]["acc_first"][0], stats[arm]["acc_last"][0]) == (acc0, acc2)

    # A hand-written reading survives regeneration, and finished runs are skipped.
    path = pathlib.Path(out, "REPORT.md")
    text = report.replace("(to be written)", "my reading")
    path.write_text(text)
    capsys.readouterr()
    assert repro_fp8rl.main(["--quick", f"--out={out}"]) == 0
    assert capsys.readouterr().out.count("done before, skipped") == 2
    assert "my reading" in path.read_text()
