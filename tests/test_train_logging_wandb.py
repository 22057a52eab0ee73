"""The W&B logger in offline mode (no network): its files, and the same metric names as JSONL."""

import glob
import json
import math
import os
import struct
import sys

import numpy as np
import pytest

from fp8rl_jax.train import WandbLogger, make_metrics_logger, read_metrics

wandb = pytest.importorskip("wandb")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    root = tmp_path / "wandb_root"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return root


def read_wandb_run(run_file):
    """(history rows, config) from an offline ``run-<id>.wandb`` file.

    The file is a 7-byte W&B header (":W&B", magic, version) then a LevelDB log: 32 KiB blocks of
    records [crc32 u32, length u16, type u8, payload]; types 1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST.
    Each reassembled payload is a wandb_internal_pb2.Record.
    """
    from wandb.proto import wandb_internal_pb2

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, pending, payloads = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            payloads.append(pending)
            pending = b""
    history, config = [], {}
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
        elif kind == "run":
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return history, config


def run_files(root):
    """The offline run files, complete: `finish()` returns before W&B's service process has
    written them; `wandb.teardown()` waits for that process to exit."""
    wandb.teardown()
    return sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb")))


def test_offline_run_logs_the_jsonl_metric_names(tmp_path, offline):
    run_dir = tmp_path / "run"
    config = {"rl": {"lr": 1e-6}, "task": "math"}
    with make_metrics_logger(run_dir, ("jsonl", "wandb"), config=config) as logger:
        logger.log(0, {"reward": np.float32(0.5), "rollout": {"kl": 1e-3}})
        logger.log(1, {"reward": 0.75, "loss": float("nan")})
    (run_file,) = run_files(offline)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert run_file.endswith(f"run-{run_id}.wandb")
    history, logged_config = read_wandb_run(run_file)
    assert logged_config["rl"] == {"lr": 1e-6} and logged_config["task"] == "math"
    jsonl = read_metrics(run_dir)
    assert [r["_step"] for r in history] == [r["step"] for r in jsonl] == [0, 1]
    for wandb_row, jsonl_row in zip(history, jsonl):
        names = {k for k in wandb_row if not k.startswith("_")}
        assert names == set(jsonl_row) - {"step"}
    assert history[0]["rollout/kl"] == pytest.approx(1e-3) and history[0]["reward"] == 0.5
    assert math.isnan(history[1]["loss"])
    assert not os.path.exists(run_dir / "tensorboard")  # not asked for


def test_resume_continues_the_same_wandb_run(tmp_path, offline):
    run_dir = tmp_path / "run"
    id_file = run_dir / "wandb_run_id"
    with WandbLogger(run_dir) as logger:
        logger.log(0, {"reward": 0.1})
    first_id = id_file.read_text().strip()
    with WandbLogger(run_dir, resume_step=1) as logger:  # a resumed run continues the W&B run
        logger.log(1, {"reward": 0.2})
    assert id_file.read_text().strip() == first_id
    files = run_files(offline)
    assert files and all(f.endswith(f"run-{first_id}.wandb") for f in files)
    steps = sorted(row["_step"] for f in files for row in read_wandb_run(f)[0])
    assert steps == [0, 1]
    with WandbLogger(run_dir):  # a fresh run in the same directory is a new W&B run
        pass
    assert id_file.read_text().strip() != first_id


def test_only_process_zero_logs_to_wandb(tmp_path, offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not even imported elsewhere
    with WandbLogger(tmp_path / "p1", process_index=1) as logger:
        logger.log(0, {"reward": 1.0})
    assert not os.path.exists(tmp_path / "p1") and not os.path.exists(offline)


def test_logger_names_and_missing_wandb(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="must include 'jsonl'"):
        make_metrics_logger(tmp_path, ("tensorboard", "wandb"))
    with pytest.raises(ValueError, match="among"):
        make_metrics_logger(tmp_path, ("jsonl", "mlflow"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'fp8rl_jax\[wandb\]'"):
        make_metrics_logger(tmp_path / "w", ("jsonl", "wandb"))
    with make_metrics_logger(tmp_path / "t", ("jsonl", "tensorboard")) as logger:
        logger.log(0, {"reward": 1.0})
    assert read_metrics(tmp_path / "t") == [{"step": 0, "reward": 1.0}]
    assert os.listdir(tmp_path / "t" / "tensorboard")
