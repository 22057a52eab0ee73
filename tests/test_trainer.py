"""The trainer (issue 6): run outputs, exact resume, SIGKILL, damaged checkpoints, non-finite stop.

Every run is `experiments/train.py` in a subprocess (the NaN-reward run: `train()` in-process,
with a reward hook), on a tiny config (D=32, 4 prompts x 4 responses, 6 steps), sharing the test
run's persistent compilation cache (conftest.py): only the first run compiles from scratch (~30 s
on 2 cores), the others take ~10 s. One uninterrupted reference run is reused by every
comparison.

Resumed runs must reproduce the reference exactly: the data of step t depends only on t, the RNG
and optimizer state are in the checkpoint, and XLA on CPU is deterministic run to run. Only the
wall-clock `rollout_time_s` is left out of the comparison.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.configs import tiny
from experiments.configs.defaults import set_path
from fp8rl_jax.tasks import score_completions
from fp8rl_jax.train import trainer
from fp8rl_jax.train.experiment import experiment_from_config
from tests.testing import TRAINER_ARM, TRAINER_FLAGS, TRAINER_STEPS, trainer_reference_run

REPO = Path(__file__).resolve().parents[1]
ARM, STEPS, TINY = TRAINER_ARM, TRAINER_STEPS, TRAINER_FLAGS
WALL_CLOCK = {"rollout_time_s"}


@pytest.fixture(scope="module")
def env():
    """The environment of every run: the test run's persistent compilation cache (conftest)."""
    return dict(os.environ)


def _overrides(run_dir, **changes) -> dict:
    return {**TINY, "trainer.run_dir": str(run_dir), **changes}


def _argv(run_dir, **changes) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in _overrides(run_dir, **changes).items()]
    config = f"--config=experiments/configs/tiny.py:{ARM}"
    return [sys.executable, "experiments/train.py", config, *flags]


def _cli(env, run_dir, **changes) -> subprocess.CompletedProcess:
    return subprocess.run(
        _argv(run_dir, **changes), cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def _metrics(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


def _assert_same_metrics(run_dir, reference):
    got, want = _metrics(run_dir), _metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g["step"], sorted(set(g) ^ set(w)))
        np.testing.assert_equal(g, w, err_msg=f"step {w['step']}")  # exact; NaN equals NaN


def _committed_steps(run_dir) -> list[int]:
    ckpt = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of STEPS steps (made once per test run, shared with
    test_reliability.py)."""
    return trainer_reference_run(tmp_path_factory)


@pytest.mark.slow
def test_run_dir_holds_all_outputs(reference):
    names = set(os.listdir(reference))
    assert {"config.json", "metrics.jsonl", "summary.json", "checkpoints", "plots"} <= names
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    assert list((reference / "plots").glob("*.png"))
    assert _committed_steps(reference) == [2, 4, 6]
    config = json.loads((reference / "config.json").read_text())
    assert config["rollout"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert config["trainer"]["steps"] == STEPS
    rows = _metrics(reference)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert all(np.isfinite(v) for r in rows for v in r.values())
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2, 4, 6]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval_accuracy_last"] == rows[-1]["eval_accuracy"]


@pytest.mark.slow
def test_sigkill_restart_and_a_longer_rerun_reproduce_uninterrupted_run(env, reference, tmp_path):
    """A run SIGKILLed once its first checkpoint is committed restarts from it with
    ``trainer.steps=4`` and ends there; a rerun with the original 6 steps resumes at step 4. The
    metrics of each equal the uninterrupted reference (one chain: three runs, not four)."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "killed.out", "w") as out:
        proc = subprocess.Popen(
            _argv(run_dir), cwd=REPO, env=env, stdout=out, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 300
            while not _committed_steps(run_dir) and proc.poll() is None:
                assert time.monotonic() < deadline, "no checkpoint after 300 s"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, f"run ended before the kill:\n{stderr[-2000:]}"
    assert "resumed" not in (tmp_path / "killed.out").read_text()
    assert not (run_dir / "summary.json").exists()
    killed_at = max(_committed_steps(run_dir))
    assert killed_at < STEPS

    restarted = _check(_cli(env, run_dir, **{"trainer.steps": 4}))
    assert "resumed from" in restarted.stdout and f"at step {killed_at}" in restarted.stdout
    got, want = _metrics(run_dir), _metrics(reference)[:5]
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    for g, w in zip(got, want):
        np.testing.assert_equal(g, w, err_msg=f"step {w['step']}")  # exact
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4

    resumed = _check(_cli(env, run_dir))
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    _assert_same_metrics(run_dir, reference)


def _damage(step_dir: Path):
    """Truncates the OCDBT manifests and data files of a checkpoint's state item."""
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            if "manifest" in name or Path(root).name == "d":
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(0)


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_to_previous(env, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    _damage(run_dir / "checkpoints" / "6")
    resumed = _check(_cli(env, run_dir))
    assert "unreadable" in resumed.stderr and str(run_dir / "checkpoints" / "6") in resumed.stderr
    assert "at step 4" in resumed.stdout
    assert any(p.name.startswith("6.corrupt-") for p in (run_dir / "checkpoints").iterdir())
    assert _committed_steps(run_dir) == [2, 4, 6]
    _assert_same_metrics(run_dir, reference)


def _nan_rewards(task, examples, completions):
    """The task's rewards, every one replaced by NaN (a broken reward function)."""
    rewards, _ = score_completions(task, examples, completions)
    return np.full_like(rewards, np.nan), 0.0


@pytest.mark.slow
def test_nan_rewards_stop_with_nonfinite_error(reference, tmp_path):
    """In-process ``train()`` with a NaN reward hook; its programs are the reference run's."""
    config = tiny.get_config(ARM)
    for path, value in _overrides(tmp_path, **{"trainer.max_nonfinite_skips": 1}).items():
        set_path(config, path, value)
    with pytest.raises(trainer.NonFiniteError) as e:
        trainer.train(experiment_from_config(config), progress=False, reward_fn=_nan_rewards)
    message = str(e.value)
    # Two minibatch updates per step, both skipped: 2 > 1 stops the run after step 1.
    assert message.startswith("2 updates skipped for a non-finite loss")
    assert "trainer.max_nonfinite_skips=1" in message and "reward_mean=nan" in message
    assert str(tmp_path / "metrics.jsonl") in message
    last = _metrics(tmp_path)[-1]
    assert last["step"] == 1 and last["nonfinite_skips"] == 2 and np.isnan(last["reward_mean"])


def test_infinite_learning_rate_is_rejected_by_the_config(env, tmp_path):
    # A non-finite lr would make every update non-finite; it is refused before any work starts.
    proc = _cli(env, tmp_path, **{"optim.lr": "inf"})
    assert proc.returncode != 0
    assert "config.optim" in proc.stderr and "lr must be finite" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# The misspelled-field case (kv_cache_dtyp=x) is test_reliability.py::test_cli_errors_are_one_line.
@pytest.mark.parametrize(
    "flag, needles",
    [
        (
            "--config.rollout.kv_cache_dtype=int4",
            ("kv_cache_dtype", "'int4'", "bfloat16", "float32", "float8_e4m3fn"),
        ),
    ],
)
def test_cli_config_errors_name_the_field(tmp_path, flag, needles):
    proc = subprocess.run(
        [
            sys.executable,
            "experiments/train.py",
            "--config=experiments/configs/tiny.py:fp8_tis",
            f"--config.trainer.run_dir={tmp_path / 'run'}",
            flag,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    for needle in needles:
        assert needle in output, output[-3000:]
    assert not (tmp_path / "run").exists()  # nothing written for an invalid config


@pytest.mark.slow
def test_export_hf_writes_the_trained_policy(env, reference, tmp_path):
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models import init_weights, load_hf_checkpoint

    out = tmp_path / "hf"
    flags = [f"--config.{k}={v}" for k, v in _overrides(reference).items()]
    argv = [
        sys.executable,
        "experiments/export_hf.py",
        f"--config=experiments/configs/tiny.py:{ARM}",
    ]
    argv += [*flags, f"--out={out}", "--dtype=float32"]
    proc = _check(subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True))
    assert f"exported step {STEPS}" in proc.stdout

    cfg, weights = load_hf_checkpoint(out, dtype=jnp.float32)
    config = tiny.get_config(ARM)
    for k, v in _overrides(reference).items():
        section, name = k.split(".")
        config[section][name] = v
    exp = experiment_from_config(config)
    want = exp.model.tiny_config(cfg.vocab_size)
    fields = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "qk_norm")
    assert all(getattr(cfg, f) == getattr(want, f) for f in (*fields, "architecture"))
    fresh = init_weights(cfg, jax.random.key(exp.trainer.seed), jnp.float32)
    assert jax.tree.structure(weights) == jax.tree.structure(fresh)
    assert all(np.isfinite(np.asarray(w)).all() for w in jax.tree.leaves(weights))
    # SFT + RL moved the weights away from the initialization
    assert not np.allclose(weights["layers"][0]["mlp"]["w_up"], fresh["layers"][0]["mlp"]["w_up"])


def test_held_out_eval_gives_exact_accuracy_and_the_tasks_mean_reward():
    """``make_eval_fn``: greedy held-out (accuracy, mean reward), the reward with partial credit."""
    import dataclasses

    from fp8rl_jax.tasks import CharTokenizer
    from fp8rl_jax.tasks.chain import ChainTask
    from fp8rl_jax.train.experiment import Experiment

    task, tok, prompt_len = (
        ChainTask(min_steps=3, max_steps=3, partial_credit=0.5),
        CharTokenizer(),
        16,
    )
    exp = Experiment()
    exp = dataclasses.replace(exp, trainer=dataclasses.replace(exp.trainer, eval_size=2))
    run = trainer._Run(exp, task, tok, None, prompt_len)  # the model config is not read
    ex0, ex1 = (task.sample(i, "eval") for i in range(2))
    last = ex1.answer.split(",")
    last[-1] = f"{(int(last[-1]) + 1) % 1000:03d}"  # the third of 3 values wrong: 2 right steps
    completions = [ex0.answer, ",".join(last)]

    def eval_generate(params, prompts, kv_scales):
        width = max(len(c) for c in completions) + 1
        rows = [tok.encode(c, add_eos=True) + [tok.pad_id] * width for c in completions]
        return np.concatenate([np.asarray(prompts.tokens_BP), [r[:width] for r in rows]], axis=1)

    state = type("State", (), {"params": None, "kv_scales": None})()
    acc, reward = trainer.make_eval_fn(run, eval_generate)(state)
    assert acc == 0.5
    np.testing.assert_allclose(reward, (1.0 + 0.5 * 2 / 3) / 2, rtol=1e-6)  # > format_reward 0.1
