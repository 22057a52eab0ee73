"""Shared test helpers (as gemma's ``gm/testing``): the tiny policy, its weights and prompts.

One tiny Qwen3-style model (D=32, 2 layers, 2 query heads over 1 KV head, vocab 64) serves the
RL-step and rollout tests, so its programs look alike across files and stay cheap on 2 cores.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.generation import Prompts, make_prompts
from fp8rl_jax.models import ModelConfig, init_weights
from fp8rl_jax.train.experiment import ModelSpec

VOCAB = 64
TINY_MODEL: ModelConfig = ModelSpec(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
).tiny_config(VOCAB)


def tiny_params(cfg: ModelConfig = TINY_MODEL, seed: int = 0) -> dict:
    """FP32 weights with O(1) logits (embedding std 1/sqrt(D), as ``train.setup.build_model``)."""
    params = init_weights(cfg, jax.random.key(seed), jnp.float32)
    params["embed"] = params["embed"] / cfg.hidden_size**0.5
    return params


def tiny_prompts(lens: Sequence[int], group: int = 1, seed: int = 0) -> Prompts:
    """``group`` rows per entry of ``lens``, each of that many random ids in [3, VOCAB)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, VOCAB, size=n).tolist() for n in lens for _ in range(group)]
    return make_prompts(rows)


def copy_tree(tree):
    """A copy that outlives donation (the train step donates its input state)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def assert_finite(metrics: dict) -> None:
    bad = {k: float(v) for k, v in metrics.items() if not np.isfinite(np.asarray(v)).all()}
    assert not bad, f"non-finite metrics: {bad}"


# The trainer-run tests (test_trainer, test_reliability) run experiments/train.py on this arm and
# these overrides, so one pytest session compiles their programs once (the compile cache).
TRAINER_ARM = "fp8kv_tis"  # FP8 W8A8 + FP8 KV cache with static scales: the most state to resume
TRAINER_STEPS = 6
TRAINER_FLAGS = {
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "model.intermediate_size": 64,
    "sft.steps": 5,
    "sft.batch_size": 16,
    "rl.group_size": 4,
    "rl.num_minibatches": 2,
    "trainer.prompts_per_step": 4,
    "trainer.steps": TRAINER_STEPS,
    "trainer.eval_size": 16,
    "trainer.eval_every": 2,  # = checkpoint_every, so a run stopped at a checkpoint logs the same
    "trainer.checkpoint_every": 2,
}


def shared_once(name: str, make: Callable[[Path], None], fallback: Path) -> Path:
    """``make(path)`` once per test run, whichever xdist worker asks first; the others wait for it
    and get the same ``path`` (conftest's ``FP8RL_TEST_SHARED_DIR``; without one, ``fallback``).
    Readers must leave it as they found it."""
    root = os.environ.get("FP8RL_TEST_SHARED_DIR")
    if root is None:
        make(fallback)
        return fallback
    path, done = Path(root) / name, Path(root) / f"{name}.done"
    with open(Path(root) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():  # a failed attempt left no marker: this worker tries again
            make(path)
            done.touch()
    return path


def trainer_argv(run_dir, *, script: str = "experiments/train.py", head=(), **changes) -> list[str]:
    """``script`` on TRAINER_ARM with TRAINER_FLAGS, ``trainer.run_dir`` and ``changes``."""
    flags = {**TRAINER_FLAGS, "trainer.run_dir": run_dir, **changes}
    return [
        *(head or (sys.executable, script)),
        f"--config=experiments/configs/tiny.py:{TRAINER_ARM}",
        *(f"--config.{k}={v}" for k, v in flags.items()),
    ]


def trainer_reference_run(tmp_path_factory) -> Path:
    """One uninterrupted TRAINER_STEPS-step run (umask 022), shared by test_trainer.py and
    test_reliability.py: a run directory they read, copy and resume against, never change."""

    def make(run_dir: Path) -> None:
        proc = subprocess.run(
            trainer_argv(run_dir), cwd=Path(__file__).resolve().parents[1], capture_output=True,
            text=True, timeout=600, umask=0o022,
        )  # fmt: skip
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"

    return shared_once("trainer_reference", make, tmp_path_factory.mktemp("reference") / "run")
