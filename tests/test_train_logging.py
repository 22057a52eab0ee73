"""Run outputs (metrics.jsonl, TensorBoard, resolved config, plots) and config conversion."""

import dataclasses
import json
import math
import os
from typing import Literal

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fp8rl_jax.train import (
    ConfigError,
    MetricsLogger,
    from_config_dict,
    plot_compare,
    plot_run,
    read_metrics,
    write_resolved_config,
)

# --- metrics -----------------------------------------------------------------------------------


def test_metrics_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"reward": np.float32(0.5), "rollout": {"kl": jnp.float32(1e-3)}})
        logger.log(1, {"reward": 0.75, "loss": float("nan")})
    records = read_metrics(tmp_path)
    assert records[0] == {"step": 0, "reward": 0.5, "rollout/kl": pytest.approx(1e-3)}
    assert records[1]["reward"] == 0.75 and math.isnan(records[1]["loss"])
    event_files = os.listdir(tmp_path / "tensorboard")
    assert any(name.startswith("events.out.tfevents") for name in event_files)


def test_metrics_reject_non_scalars_and_reserved_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="'x' must be a scalar"):
            logger.log(0, {"x": np.zeros(3)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(0, {"step": 1})


def test_resume_drops_records_at_or_after_start_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(6):
            logger.log(step, {"reward": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # a line torn by the crash
    # The checkpoint was at step 4: the resumed run replays steps 4, 5, ...
    with MetricsLogger(tmp_path, resume_step=4) as logger:  # TensorBoard purges from step 4
        logger.log(4, {"reward": 40.0})
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path)] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    with MetricsLogger(tmp_path, tensorboard=False):  # a fresh run in the same dir starts clean
        pass
    assert read_metrics(tmp_path) == []


def test_only_process_zero_writes(tmp_path):
    with MetricsLogger(tmp_path / "p1", process_index=1) as logger:
        logger.log(0, {"reward": 1.0})
    assert write_resolved_config(tmp_path / "p1", {"a": 1}, process_index=1) is None
    assert not os.path.exists(tmp_path / "p1")


@dataclasses.dataclass(frozen=True)
class _Rollout:
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16"  # KV cache storage
    temperature: float = 1.0  # sampling temperature

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class _Config:
    rollout: _Rollout = dataclasses.field(default_factory=_Rollout)
    lr: float = 1e-6  # learning rate
    steps: int = 10  # RL steps
    task: str = "addition"  # task name
    layers_bf16: tuple[int, ...] = ()  # layers kept in BF16
    eval_every: int | None = None  # steps between evals; None: never
    run_name: str = dataclasses.field(default="run")


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def test_write_resolved_config(tmp_path):
    cd = ml_collections.ConfigDict({"lr": 1e-6, "rollout": {"kv_cache_dtype": "fp8"}})
    path = write_resolved_config(tmp_path, cd)
    assert _read_json(path) == {"lr": 1e-6, "rollout": {"kv_cache_dtype": "fp8"}}
    config = from_config_dict(_Config, cd)
    loaded = _read_json(write_resolved_config(tmp_path, config))
    assert loaded["rollout"] == {"kv_cache_dtype": "fp8", "temperature": 1.0}
    assert loaded["layers_bf16"] == [] and loaded["eval_every"] is None


# --- plots -------------------------------------------------------------------------------------


def _fake_run(run_dir, scale):
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step in range(5):
            metrics = {"reward": scale * step, "train/accuracy": 0.1 * step, "rollout/kl": 1e-3}
            if step % 2 == 0:
                metrics["eval/accuracy"] = 0.2 * step
            logger.log(step, metrics)


def test_plot_run_writes_pngs_and_skips_missing_keys(tmp_path):
    _fake_run(tmp_path / "a", 1.0)
    paths = plot_run(tmp_path / "a")
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["accuracy.png", "mismatch_kl.png", "reward.png"]  # no rollout time logged
    with MetricsLogger(tmp_path / "b", tensorboard=False) as logger:  # the trainer's names
        for step in range(3):
            logger.log(step, {"reward_mean": 0.1, "train_accuracy": 0.2, "kl": 1e-4})
            logger.log(step, {"eval_accuracy": 0.3, "rollout_time_s": 1.5, "reward_std": 0.0})
    names = sorted(os.path.basename(p) for p in plot_run(tmp_path / "b"))
    assert names == ["accuracy.png", "mismatch_kl.png", "reward.png", "rollout_time.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot_run(tmp_path / "nothing") == []


def test_plot_compare(tmp_path):
    _fake_run(tmp_path / "bf16", 1.0)
    _fake_run(tmp_path / "fp8", 0.9)
    out = plot_compare(
        [tmp_path / "bf16", tmp_path / "fp8"], ["bf16", "fp8"], tmp_path / "cmp.png", "reward"
    )
    assert os.path.getsize(out) > 1000
    with pytest.raises(ValueError, match="has metric 'nope'"):
        plot_compare([tmp_path / "bf16"], ["bf16"], tmp_path / "x.png", "nope")


# --- config ------------------------------------------------------------------------------------


def test_from_config_dict_builds_nested_frozen_dataclasses():
    cd = ml_collections.ConfigDict(
        {"rollout": {"kv_cache_dtype": "fp8"}, "lr": 3, "layers_bf16": [0, 1], "eval_every": 5}
    )
    config = from_config_dict(_Config, cd)
    assert config == _Config(
        rollout=_Rollout(kv_cache_dtype="fp8"), lr=3.0, layers_bf16=(0, 1), eval_every=5
    )
    assert isinstance(config.lr, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"rollout": {"kv_cache_dtyp": "fp8"}},
            "config.rollout.kv_cache_dtyp: unknown field; did you mean kv_cache_dtype?",
        ),
        (
            {"rollout": {"kv_cache_dtype": "fp16"}},
            "config.rollout.kv_cache_dtype: 'fp16' is not allowed; allowed values: ['bf16', 'fp8']",
        ),
        ({"steps": 2.5}, "config.steps: expected int, got float (2.5)"),
        ({"steps": True}, "config.steps: expected int, got bool (True)"),
        ({"lr": "fast"}, "config.lr: expected float, got str ('fast')"),
        ({"layers_bf16": [0, "x"]}, "config.layers_bf16[1]: expected int, got str ('x')"),
        ({"eval_every": "often"}, "config.eval_every: 'often' matches no type of the union"),
        ({"rollout": 3}, "config.rollout: expected a mapping of fields, got int"),
        ({"rollout": {"temperature": 0.0}}, "config.rollout: temperature must be > 0, got 0.0"),
        ({"zzz": 1}, "config.zzz: unknown field; known fields: ["),
    ],
)
def test_from_config_dict_errors_name_the_field_path(values, message):
    with pytest.raises(ConfigError) as e:
        from_config_dict(_Config, values)
    assert str(e.value).startswith(message), str(e.value)


def test_missing_required_field():
    @dataclasses.dataclass(frozen=True)
    class Needs:
        path: str  # no default

    with pytest.raises(ConfigError, match=r"^config.path: missing required field$"):
        from_config_dict(Needs, {})
