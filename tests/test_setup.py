"""scripts/setup.sh picks the jax build for the machine, and refuses one the machine cannot run.

Run as a subprocess with ``--dry-run`` (it prints the pip commands and installs nothing) and with
detection pointed at fakes: an ``nvidia-smi`` script that prints a driver and a GPU name, and a
directory of TPU device files.
"""

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JAX = re.search(r"^jax==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
BASE = "would run: .venv/bin/python -m pip install -q -e .[dev]"


def _setup(tmp_path, *args, driver=None, tpu=False, accel=None):
    smi = tmp_path / "nvidia-smi"
    if driver is not None:
        smi.write_text(f'#!/bin/sh\necho "{driver}, NVIDIA H100 80GB HBM3"\n')
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    devices = tmp_path / "dev"
    devices.mkdir(exist_ok=True)
    if tpu:
        (devices / "accel0").touch()
    env = {
        **os.environ,
        "FP8RL_NVIDIA_SMI": str(smi),  # missing when driver is None: no GPU
        "FP8RL_TPU_DEVICES": f"{devices}/accel*",
    }
    env.pop("FP8RL_ACCEL", None)
    if accel:
        env["FP8RL_ACCEL"] = accel
    cmd = ["bash", str(REPO / "scripts" / "setup.sh"), "--dry-run", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _commands(proc):
    return [line for line in proc.stdout.splitlines() if line.startswith("would run:")]


@pytest.mark.parametrize(
    ("kwargs", "accel"),
    [
        ({}, "cpu"),  # nothing found: the CPU machine the README's first commands run on
        ({"driver": "575.57.08"}, "cuda12"),
        ({"driver": "580.65.06"}, "cuda13"),
        ({"tpu": True}, "tpu"),
    ],
)
def test_detects_the_accelerator(tmp_path, kwargs, accel):
    proc = _setup(tmp_path, **kwargs)
    assert proc.returncode == 0, proc.stderr
    assert f"detected accelerator: {accel}" in proc.stdout
    extra = (
        []
        if accel == "cpu"
        else [f"would run: .venv/bin/python -m pip install -q jax[{accel}]=={JAX}"]
    )
    assert _commands(proc) == [BASE, *extra]


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("accel", ["cuda12", "cuda13"])
def test_asked_for_cuda_installs_that_extra(tmp_path, how, accel):
    args = [f"--accel={accel}"] if how == "flag" else []
    proc = _setup(tmp_path, *args, driver="590.10", accel=accel if how == "env" else None)
    assert proc.returncode == 0, proc.stderr
    assert _commands(proc) == [
        BASE,
        f"would run: .venv/bin/python -m pip install -q jax[{accel}]=={JAX}",
    ]


def test_asked_for_cpu_on_a_gpu_machine_installs_cpu_jax(tmp_path):
    proc = _setup(tmp_path, "--accel=cpu", driver="590.10")
    assert proc.returncode == 0 and _commands(proc) == [BASE]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (["--accel=cuda13"], {}, "--accel=cuda13 asked for, but no NVIDIA GPU was found"),
        (["--accel=cuda12"], {"tpu": True}, "--accel=cuda12 asked for, but no NVIDIA GPU"),
        (
            ["--accel=cuda13"],
            {"driver": "575.57.08"},
            "--accel=cuda13 needs an NVIDIA driver >= 580, found 575 on NVIDIA H100",
        ),
        (["--accel=cuda12"], {"driver": "470.1"}, "needs an NVIDIA driver >= 525, found 470"),
        ([], {"driver": "470.1"}, "older than CUDA 12's minimum (525)"),
        (["--accel=tpu"], {"driver": "590.1"}, "--accel=tpu asked for, but no TPU device"),
        (["--accel=rocm"], {}, "unknown accelerator 'rocm'"),
        (["--bogus"], {}, "unknown argument --bogus"),
    ],
)
def test_refuses_a_mismatch_before_installing(tmp_path, args, kwargs, message):
    proc = _setup(tmp_path, *args, **kwargs)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert _commands(proc) == []  # nothing would be installed


def _experiment(config_module, **changes):
    from experiments.configs.defaults import set_path
    from fp8rl_jax.train.experiment import experiment_from_config

    config = config_module.get_config()
    for path, value in changes.items():
        set_path(config, path, value)
    return experiment_from_config(config)


def test_a_config_meant_for_gpus_stops_on_a_cpu_only_jax():
    import jax

    from experiments.configs import base, qwen3_8b
    from fp8rl_jax.train.checks import check_devices, device_summary
    from fp8rl_jax.train.config import ConfigError

    assert jax.default_backend() == "cpu"  # the suite runs on CPU
    assert device_summary() == f"{jax.device_count()} x cpu (cpu)"
    fix = REPO / "tests" / "fixtures"
    paths = {
        "model.hf_checkpoint": str(fix / "hf" / "qwen3"),
        "task.jsonl_path": str(fix / "verl" / "dapo_math_tiny.parquet"),
    }
    exp = _experiment(qwen3_8b, **paths)
    assert exp.trainer.allow_cpu is False  # hf_base: the real-model recipe
    with pytest.raises(ConfigError, match="meant for GPUs/TPUs, but jax found only CPU") as e:
        check_devices(exp)
    assert "--config.trainer.allow_cpu=True" in str(e.value) and "\n" not in str(e.value)
    check_devices(_experiment(qwen3_8b, **paths, **{"trainer.allow_cpu": True}))  # allowed
    check_devices(_experiment(base))  # the tiny CPU run
    n = jax.device_count()
    with pytest.raises(ConfigError, match=rf"data={8 * n},.*found only CPU devices"):
        check_devices(_experiment(base, **{"mesh.data": 8 * n, "trainer.allow_cpu": True}))


@pytest.mark.parametrize(
    ("mesh", "devices", "grad_accum", "want"),
    [
        # 512 rows / 32 = 16-row micro-batches: over data=4 only of 4 x 8 devices (8x each row)
        ({"mesh.data": -1, "mesh.fsdp": 8}, 32, 32, "16 rows splits over 4 of the 32 devices"),
        ({"mesh.data": -1, "mesh.fsdp": 8}, 32, 16, None),  # 32 rows: one per device
        ({"mesh.data": 1, "mesh.fsdp": -1}, 8, 32, None),  # 16 rows over 8: two per device
        # fsdp=4 divides 16, expert=8 does not: 4 of 32 devices, rl.grad_accum=16 the fix
        ({"mesh.data": 1, "mesh.fsdp": -1, "mesh.expert": 8}, 32, 32, "over 4 of the 32"),
    ],
)
def test_rows_that_do_not_split_over_every_device_are_named(mesh, devices, grad_accum, want):
    from experiments.configs import qwen3_8b
    from fp8rl_jax.train.checks import row_split_warnings

    fix = REPO / "tests" / "fixtures"
    paths = {
        "model.hf_checkpoint": str(fix / "hf" / "qwen3"),
        "task.jsonl_path": str(fix / "verl" / "dapo_math_tiny.parquet"),
    }
    exp = _experiment(qwen3_8b, **paths, **mesh, **{"rl.grad_accum": grad_accum})
    lines = row_split_warnings(exp, devices)
    if want is None:
        assert lines == []
        return
    assert len(lines) == 1 and want in lines[0]
    assert lines[0].startswith("config.rl.grad_accum=32:")
    assert "computed on 8 devices" in lines[0]
    assert lines[0].endswith("rl.grad_accum=16 gives micro-batches of 32 rows")
