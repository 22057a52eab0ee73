"""Nothing lost, nothing silent (issue 13): each of its cases 1-9 as a test.

  1 export safety        test_export_*
  2 the run-dir lock     test_second_run_*, test_lock_*
  3 failing save         test_failing_save_*
  4 same-size flips      test_byte_flips_*
  5 config.json kept     test_incompatible_rerun_*, test_byte_flips_* (config.1.json)
  6 SIGINT / SIGTERM     test_sigterm_*, test_sigint_*, test_second_signal_*
  7-8 named errors       test_config_errors_*, test_load_errors_*, test_cli_errors_*
  9 file modes           test_files_are_*

Runs are ``experiments/train.py`` subprocesses on test_trainer's tiny shapes (the test run's
persistent compile cache, conftest.py, serves every run after the first); one uninterrupted run
(``reference``) is shared: exported, copied and damaged, resumed against.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.configs import tiny
from experiments.configs.defaults import set_path
from fp8rl_jax.train.experiment import experiment_from_config
from tests.testing import TRAINER_ARM, TRAINER_FLAGS, TRAINER_STEPS, trainer_reference_run

REPO = Path(__file__).resolve().parents[1]
ARM, STEPS, TINY = TRAINER_ARM, TRAINER_STEPS, TRAINER_FLAGS
WALL_CLOCK = {"rollout_time_s"}
WORKER = str(REPO / "tests" / "reliability_worker.py")


def _argv(run_dir, *, script="experiments/train.py", worker=None, **changes) -> list[str]:
    flags = [
        f"--config.{k}={v}" for k, v in {**TINY, "trainer.run_dir": run_dir, **changes}.items()
    ]
    head = [sys.executable, WORKER, worker] if worker else [sys.executable, script]
    return [*head, f"--config=experiments/configs/tiny.py:{ARM}", *flags]


def _run(argv, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          umask=0o022)  # fmt: skip


def _popen(argv) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, umask=0o022)  # fmt: skip


def _ok(proc) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def _one_line_error(proc, code: int = 1) -> str:
    """The run failed with ``code`` and printed one ``error:`` line and no traceback."""
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


def _assert_same_metrics(run_dir, reference):
    got, want = _metrics(run_dir), _metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        np.testing.assert_equal(g, w, err_msg=f"step {w['step']}")  # exact; NaN equals NaN


def _committed(run_dir) -> list[int]:
    return sorted(
        int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit()
    )


def _listing(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of STEPS steps (umask 022; made once per test run, shared with
    test_trainer.py)."""
    return trainer_reference_run(tmp_path_factory)


# 1. Export safety -------------------------------------------------------------------------


@pytest.mark.slow
def test_export_never_deletes_what_it_did_not_write(reference, tmp_path):
    before = _listing(reference)
    proc = _run(_argv(reference, script="experiments/export_hf.py") + [f"--out={reference}"])
    assert "ExportDirError" in _one_line_error(proc) and "run directory" in proc.stderr
    assert _listing(reference) == before  # checkpoints, metrics, TensorBoard: untouched

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "README.md").write_text("mine")
    export = _argv(reference, script="experiments/export_hf.py") + [f"--out={foreign}"]
    line = _one_line_error(_run(export))
    assert "is not empty and is not a previous export" in line and "--overwrite" in line
    assert _listing(foreign) == {"README.md": b"mine"}

    out = _ok(_run([*export, "--overwrite"]))
    assert f"exported step {STEPS}" in out.stdout
    names = set(os.listdir(foreign))
    assert {"README.md", "config.json", "model.safetensors", "fp8rl_export.json"} <= names
    assert (foreign / "README.md").read_text() == "mine"
    marker = json.loads((foreign / "fp8rl_export.json").read_text())
    assert marker["step"] == STEPS and "README.md" not in marker["files"]
    _ok(_run(export))  # a previous export: replaced without --overwrite, README kept
    assert (foreign / "README.md").read_text() == "mine"
    _assert_modes(foreign)


def test_export_replaces_a_previous_export_and_refuses_foreign_weights(tmp_path):
    from fp8rl_jax.models import save_hf_checkpoint
    from fp8rl_jax.models.hf import ExportDirError
    from tests.testing import TINY_MODEL, tiny_params

    out = tmp_path / "hf"
    save_hf_checkpoint(out, TINY_MODEL, tiny_params())
    (out / "NOTES.txt").write_text("added by hand")
    save_hf_checkpoint(out, TINY_MODEL, tiny_params(seed=1))  # replaces only what it wrote
    assert sorted(os.listdir(out)) == [
        "NOTES.txt", "config.json", "fp8rl_export.json", "model.safetensors"
    ]  # fmt: skip
    other = tmp_path / "other"
    other.mkdir()
    (other / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(ExportDirError, match="would mix both"):
        save_hf_checkpoint(other, TINY_MODEL, tiny_params(), overwrite=True)
    assert os.listdir(other) == ["model-00001-of-00002.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["hf", "other"]  # no temporary left behind
    old = os.umask(0o022)
    try:
        save_hf_checkpoint(tmp_path / "new", TINY_MODEL, tiny_params())
    finally:
        os.umask(old)
    _assert_modes(tmp_path / "new")  # safetensors alone writes 0600


# 2. The lock ------------------------------------------------------------------------------

_HOLD = (
    "import sys; from fp8rl_jax.train.run_dir import RunLock;"
    " lock = RunLock(sys.argv[1]).acquire(); print('locked', flush=True); sys.stdin.read()"
)


def _holder(run_dir) -> subprocess.Popen:
    os.makedirs(run_dir, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_a_locked_run_dir_is_refused(tmp_path):
    from fp8rl_jax.train.run_dir import RunDirLocked, RunLock

    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host"):
            RunLock(str(run_dir)).acquire()
        line = _one_line_error(_run(_argv(run_dir)))
        assert "RunDirLocked" in line and f"pid {holder.pid}" in line and "in use" in line
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert sorted(os.listdir(run_dir)) == ["run.lock"]  # the refused run wrote nothing
    RunLock(str(run_dir)).acquire().release()  # a released lock is free, without a warning


def test_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    from fp8rl_jax.train.run_dir import RunLock

    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    holder.kill()  # SIGKILL: the file still names it, the kernel dropped its flock
    holder.wait(30)
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING), RunLock(str(run_dir)).acquire():
        held = json.loads((run_dir / "run.lock").read_text())
    assert held["pid"] == os.getpid()
    assert f"stale lock {run_dir / 'run.lock'} of pid {holder.pid}" in caplog.text
    assert "no longer running" in caplog.text
    assert (run_dir / "run.lock").read_text() == ""  # released: no stale holder left


# 3. A failing save ------------------------------------------------------------------------


@pytest.mark.slow
def test_failing_save_exits_with_one_line_instead_of_hanging(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(_argv(run_dir, worker="fail-save"), timeout=240)  # it used to hang for 20 min
    line = _one_line_error(proc)
    assert "CheckpointSaveError: saving checkpoint step 2" in line and "Permission denied" in line
    assert f"traceback in {run_dir / 'error.log'}" in line
    assert "Traceback" in (run_dir / "error.log").read_text()
    assert (run_dir / "run.lock").read_text() == ""


# 4-5. Same-size corruption; config.json kept ----------------------------------------------


def _flip_bytes(step_dir: Path, n: int = 400, name: str | None = None) -> Path:
    """XORs n bytes in the middle of the step's state file called `name`, or of its largest
    (which orbax versions differ on: a data chunk or `_METADATA`); its size is kept."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    if name is not None:
        files = [p for p in files if p.name == name]
    file = max(files, key=os.path.getsize)
    data = bytearray(file.read_bytes())
    start = max(0, len(data) // 2 - n // 2)
    for i in range(start, min(len(data), start + n)):
        data[i] ^= 0xFF
    size = len(data)
    file.write_bytes(bytes(data))
    assert file.stat().st_size == size
    return file


@pytest.mark.parametrize("name", [None, "_METADATA"], ids=["largest", "metadata"])
def test_byte_flips_in_a_checkpoint_are_detected(tmp_path, caplog, name):
    import jax.numpy as jnp

    from fp8rl_jax.train.checkpoint import CheckpointManager

    state = {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones((7,), jnp.bfloat16)}
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, {"w": state["w"] + 1, "b": state["b"]})
    file = _flip_bytes(tmp_path / "ckpt" / "2", name=name)
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore_latest(state)
        assert ckpt.all_steps() == [1]
    assert restored.step == 1
    np.testing.assert_array_equal(restored.state["w"], np.arange(4096, dtype=np.float32))
    assert f"{file}: sha256" in caplog.text and "the bytes were altered" in caplog.text
    assert [p.name.split("-")[0] for p in (tmp_path / "ckpt").iterdir() if "corrupt" in p.name] == [
        "2.corrupt"
    ]


@pytest.mark.slow
def test_byte_flips_in_a_run_fall_back_and_a_changed_config_is_kept_aside(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    config = (run_dir / "config.json").read_bytes()
    file = _flip_bytes(run_dir / "checkpoints" / str(STEPS))
    proc = _ok(_run(_argv(run_dir, **{"trainer.keep_checkpoints": 4})))
    assert f"{file}: sha256" in proc.stderr and f"at step {STEPS - 2}" in proc.stdout
    assert any(p.name.startswith(f"{STEPS}.corrupt-") for p in (run_dir / "checkpoints").iterdir())
    assert _committed(run_dir) == [2, 4, 6]
    _assert_same_metrics(run_dir, reference)
    assert (run_dir / "config.json").read_bytes() == config  # the original run's
    changed = json.loads((run_dir / "config.1.json").read_text())
    assert changed["trainer"]["keep_checkpoints"] == 4
    assert "trainer.keep_checkpoints: 3 -> 4" in proc.stderr


@pytest.mark.slow
def test_incompatible_rerun_keeps_config_json(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = _listing(run_dir)
    proc = _run(_argv(run_dir, **{"model.hidden_size": 64}))
    line = _one_line_error(proc)
    assert "ResumeError" in line and "model.hidden_size: 32 -> 64" in line
    assert "params.embed: stored shape (55, 32), this config expects (55, 64)" in proc.stderr
    after = _listing(run_dir)
    assert after.pop("error.log")  # the traceback, for --verbose readers
    assert after == before  # config.json, checkpoints and metrics as they were


# 6. SIGINT / SIGTERM ----------------------------------------------------------------------


def _wait_for(predicate, proc, what: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"{what}: run ended early\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: timed out"
        time.sleep(0.02)


def _rows(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_sigterm_mid_step_saves_that_step_and_the_rerun_resumes_there(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _popen(_argv(run_dir))
    _wait_for(lambda: _rows(run_dir) >= 2, proc, "row of step 1")  # rows 0, 1: in step 2
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM after step ") and "rerun the same command" in last
    step = int(last.split("after step ")[1].split()[0])
    assert 2 <= step < STEPS and _committed(run_dir)[-1] == step
    assert _metrics(run_dir)[-1]["step"] == step  # flushed up to the saved step
    resumed = _ok(_run(_argv(run_dir)))
    assert f"at step {step}" in resumed.stdout
    _assert_same_metrics(run_dir, reference)


@pytest.mark.slow
def test_sigint_mid_save_lets_the_save_commit_then_saves_the_current_step(tmp_path):
    from fp8rl_jax.train.integrity import verify_manifest

    run_dir, release = tmp_path / "run", tmp_path / "release"
    proc = _popen(_argv(run_dir, worker=f"slow-save:{release}"))
    lines = iter(proc.stdout.readline, "")
    assert next(line for line in lines if line.startswith("SAVE_IN_FLIGHT")).split()[1] == "2"
    proc.send_signal(signal.SIGINT)  # while step 2 is being written
    time.sleep(0.5)
    release.touch()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGINT, err[-4000:]
    assert "Traceback" not in err and "cannot schedule new futures" not in err, err[-4000:]
    step = int(err.strip().splitlines()[-1].split("after step ")[1].split()[0])
    committed = _committed(run_dir)  # 2, maybe the next due step (if its save waited), the stop
    assert committed[0] == 2 and committed[-1] == step > 2, committed
    for s in committed:
        verify_manifest(run_dir / "checkpoints" / str(s))
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


def test_second_signal_exits_at_once(tmp_path):
    script = (
        "import time; from fp8rl_jax.train.shutdown import StopSignals\n"
        "with StopSignals() as s:\n"
        "    s.arm(); print('armed', flush=True); time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "armed"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None  # the first one waits for the step
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - start < 30
    assert "SIGINT again: exiting at once" in err


# 7-8. Errors that name the problem ---------------------------------------------------------


def _config(**changes):
    config = tiny.get_config("fp8_tis")
    for path, value in changes.items():
        set_path(config, path, value)
    return config


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"rl.num_minibatches": 3}, "rl.num_minibatches=3 x rl.grad_accum=1 must divide the 512"),
        ({"rl.grad_accum": 5}, "rl.grad_accum=5 must divide"),
        ({"model.hidden_size": 0}, "model.hidden_size must be >= 1, got 0"),
        ({"rollout.compute_dtype": "fp16"}, "config.rollout.compute_dtype: 'fp16' is not allowed"),
        ({"rollout.decode_attention_impl": "cuda"}, "config.rollout.decode_attention_impl"),
        (
            {"rl.correction.bypass": True, "rl.correction.rs_level": "token"},
            "rl.correction.bypass=True makes every ratio 1",
        ),
    ],
)
def test_config_errors_name_the_field(changes, needle):
    from fp8rl_jax.train.config import ConfigError

    with pytest.raises(ConfigError) as e:
        experiment_from_config(_config(**changes))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_config_errors_that_need_devices_or_data_name_the_field():
    import jax

    from fp8rl_jax.train.checks import check_devices, check_eval_size
    from fp8rl_jax.train.config import ConfigError
    from fp8rl_jax.train.setup import build_task

    n = jax.device_count()
    with pytest.raises(ConfigError, match=rf"config.mesh: .*{n + 1}") as e:
        check_devices(experiment_from_config(_config(**{"mesh.data": n + 1})))
    assert "\n" not in str(e.value)
    data = REPO / "tests" / "fixtures" / "data"
    exp = experiment_from_config(_config(**{
        "task.name": "math", "task.jsonl_path": str(data / "math_tiny.jsonl"),
        "task.eval_jsonl_path": str(data / "math_tiny_eval.jsonl"), "trainer.eval_size": 16,
        "task.tokenizer_path": str(REPO / "tests" / "fixtures" / "hf" / "tokenizer"),
    }))  # fmt: skip
    task, _ = build_task(exp.task, exp.model.hf_checkpoint)
    with pytest.raises(ConfigError) as e:
        check_eval_size(exp, task)
    assert str(e.value).startswith("config.trainer.eval_size=16 is more than the 2 problems")
    assert "math_tiny_eval.jsonl" in str(e.value) and "\n" not in str(e.value)


HF = REPO / "tests" / "fixtures" / "hf" / "qwen3"


def _hf_copy(tmp_path) -> Path:
    return Path(shutil.copytree(HF, tmp_path / "qwen3"))


def test_load_errors_name_the_tensor_file_key_or_line(tmp_path):
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file

    from fp8rl_jax.models import load_hf_checkpoint
    from fp8rl_jax.models.hf import CheckpointError
    from fp8rl_jax.tasks.datasets import MathJsonlDataset

    path = _hf_copy(tmp_path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name].flat[[3, 5]] = [np.nan, np.inf]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(path, dtype=jnp.float32)
    assert f"NaN/Inf in 1 tensor(s) as loaded in float32: {name} (2 of " in str(e.value)
    assert "in model.safetensors)" in str(e.value) and "\n" not in str(e.value)

    data = (HF / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])  # a cut-off download
    with pytest.raises(CheckpointError, match=f"^{path / 'model.safetensors'}: not a readable"):
        load_hf_checkpoint(path)

    config = json.loads((HF / "config.json").read_text())
    del config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^{path / 'config.json'}: missing key 'hidden_size'$"):
        load_hf_checkpoint(path)

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_bytes(b'{"question": "1+1", "answer": 2}\n{"question": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ValueError, match=f"^{jsonl}:2: not valid UTF-8"):
        MathJsonlDataset(jsonl)


def test_unusable_run_dir_is_named(tmp_path):
    from fp8rl_jax.train.run_dir import RunDirError, prepare_run_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match=r"^trainer.run_dir=.*file.*exists and is not a dir"):
        prepare_run_dir(str(tmp_path / "file"))
    with pytest.raises(RunDirError, match=r"^trainer.run_dir=.*: cannot create"):
        prepare_run_dir(str(tmp_path / "file" / "run"))


@pytest.mark.parametrize(
    "flag, needle",
    [
        ("--config.rollout.kv_cache_dtyp=x", "config.rollout.kv_cache_dtyp: unknown field; did you"
         " mean kv_cache_dtype?"),
        ("--config.model.hidden_size=0", "model.hidden_size must be >= 1, got 0"),
        ("--config.mesh.data=2", "config.mesh"),
        ("--config.trainer.run_dir=/dev/null", "/dev/null exists and is not a directory"),
    ],
)  # fmt: skip
def test_cli_errors_are_one_line(tmp_path, flag, needle):
    argv = [sys.executable, "experiments/train.py", "--config=experiments/configs/tiny.py:fp8_tis",
            f"--config.trainer.run_dir={tmp_path / 'run'}", flag]  # fmt: skip
    proc = _run(argv, timeout=120)
    line = _one_line_error(proc, code=2 if "dtyp=" in flag else 1)
    assert needle in line, line
    assert not (tmp_path / "run").exists()  # nothing written
    verbose = _run([*argv, "--verbose"], timeout=120) if "hidden" in flag else None
    assert verbose is None or "Traceback" in verbose.stderr


# 9. File modes ----------------------------------------------------------------------------


def _assert_modes(path, mode: int = 0o644):
    wrong = {
        str(p.relative_to(path)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in Path(path).rglob("*")
        if p.is_file() and stat.S_IMODE(p.stat().st_mode) != mode
    }
    assert not wrong, wrong


@pytest.mark.slow
def test_files_are_0644_under_umask_022(reference):
    assert {"config.json", "metrics.jsonl", "summary.json", "run.lock"} <= set(
        os.listdir(reference)
    )
    _assert_modes(reference)  # metrics, config, TensorBoard, plots, checkpoints


def test_files_follow_the_umask(tmp_path):
    from fp8rl_jax.files import atomic_write_text

    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["a.json"]


# Issue 25: nothing misread --------------------------------------------------------------------
#   1 Ctrl-C during the resume's restore     test_sigint_during_the_resume_restore_*
#   2 export beside a live run               test_export_beside_a_trainer_*, test_checkpoint.py
#   3 cross-field config rules               test_cross_field_rules_*
#   4 the run directory's shape              test_checkpoints_path_*
#   5 JSON errors name the real column       test_jsonl_errors_*


@pytest.mark.slow
def test_sigint_during_the_resume_restore_exits_at_once_and_moves_nothing(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = _listing(run_dir)
    proc = _run(_argv(run_dir, worker="sigint-restore"), timeout=240)
    assert f"SIGINT_AT {STEPS}" in proc.stdout  # the signal came as the newest step was read
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "damaged" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("stopped by SIGINT before the first")
    assert "resumed" not in proc.stdout  # it exits at once: no step redone
    assert _listing(run_dir) == before  # every checkpoint in place, none moved aside


def _reference_experiment(run_dir):
    config = tiny.get_config(ARM)
    for path, value in {**TINY, "trainer.run_dir": str(run_dir)}.items():
        set_path(config, path, value)
    return experiment_from_config(config)


@pytest.mark.slow
@pytest.mark.parametrize("leases", [True, False])
def test_export_beside_a_trainer_saving_with_keep_1(reference, tmp_path, monkeypatch, leases):
    """The trainer commits a step and cleans up (keep 1) while the export reads its checkpoint:
    the export holds the step it chose (a lease), or without flock reads the next newest."""
    import fp8rl_jax.train.checkpoint as checkpoint_lib
    from fp8rl_jax.train.checkpoint import CheckpointManager
    from fp8rl_jax.train.export import export_hf
    from fp8rl_jax.train.setup import abstract_train_state, build_task

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    exp = _reference_experiment(run_dir)
    model_cfg = exp.model.tiny_config(build_task(exp.task)[1].vocab_size)
    trainer = CheckpointManager(run_dir / "checkpoints", max_to_keep=1)
    state = trainer.restore_latest(abstract_train_state(exp, model_cfg)).state
    if not leases:
        monkeypatch.setattr(checkpoint_lib, "reading", lambda path: contextlib.nullcontext())
    verify, saved = checkpoint_lib.verify_manifest, []

    def verify_while_the_trainer_saves(step_dir):
        if not saved:
            saved.append(trainer.save(STEPS + 1, state))
            trainer.wait_until_finished()  # commits, then removes every unleased older step
        return verify(step_dir)

    monkeypatch.setattr(checkpoint_lib, "verify_manifest", verify_while_the_trainer_saves)
    step = export_hf(exp, str(tmp_path / "export"))
    assert saved == [True] and step == (STEPS if leases else STEPS + 1)
    assert json.loads((tmp_path / "export" / "fp8rl_export.json").read_text())["step"] == step
    assert _committed(run_dir) == ([STEPS, STEPS + 1] if leases else [STEPS + 1])
    trainer.close()  # its next clean-up removes the step the export held
    assert _committed(run_dir) == [STEPS + 1]


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"rl.group_size": 1}, "rl.group_size=1 with rl.advantage='grpo': a group-relative"),
        ({"rl.group_size": 1, "rl.advantage": "rloo"}, "rl.group_size=1 with rl.advantage='rloo'"),
        (
            {"rl.group_size": 1, "rl.advantage": "gae", "rl.dapo.dynamic_sampling": True},
            "rl.dapo.dynamic_sampling=True with rl.group_size=1",
        ),
        (
            {"rl.dapo.dynamic_sampling": True, "rl.dapo.gen_prompts": 3},
            "rl.dapo.gen_prompts=3 is less than trainer.prompts_per_step=32",
        ),
        (
            {"rollout.kv_cache_dtype": "float8_e4m3fn", "rollout.kv_calib_percentile": 0.0},
            "rollout.kv_calib_percentile=0.0 must be in (0, 100] with rollout.kv_cache_dtype=",
        ),
        (
            {"rollout.kv_cache_dtype": "float8_e4m3fn", "rollout.kv_calib_margin": 0.0},
            "rollout.kv_calib_margin=0.0 must be > 0 with rollout.kv_cache_dtype=",
        ),
        (
            {"rollout.engine": "paged", "rollout.max_new_tokens": 64,
             "rollout.paged.page_size": 16, "rollout.paged.num_pages": 5},
            "rollout.paged.num_pages=5 cannot hold one request of rollout.max_new_tokens=64 "
            "tokens (+ a prompt) in pages of rollout.paged.page_size=16: it needs at least 6",
        ),
        ({"task.name": "math"}, "task.name='math' needs task.jsonl_path"),
        (
            {"task.name": "math", "task.jsonl_path": "train.jsonl"},
            "task.name='math' needs an HF tokenizer: task.tokenizer_path or model.hf_checkpoint",
        ),
    ],
)  # fmt: skip
def test_cross_field_rules_fail_at_config_time_naming_the_fields(changes, needle):
    from fp8rl_jax.train.config import ConfigError

    with pytest.raises(ConfigError) as e:
        experiment_from_config(_config(**changes))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cross_field_rules_allow_what_works():
    exp = experiment_from_config(_config(**{"rl.group_size": 1, "rl.advantage": "gae"}))
    assert exp.rl.group_size == 1  # a critic's baseline needs no group
    paged = {"rollout.engine": "paged", "rollout.max_new_tokens": 64,
             "rollout.paged.page_size": 16, "rollout.paged.num_pages": 6}  # fmt: skip
    assert experiment_from_config(_config(**paged)).rollout.paged.num_pages == 6


@pytest.mark.parametrize("shape", ["file", "dangling link", "read-only"])
def test_checkpoints_path_of_the_wrong_shape_stops_before_any_work(tmp_path, monkeypatch, shape):
    from fp8rl_jax.train import run_dir as run_dir_lib
    from fp8rl_jax.train import trainer as trainer_lib
    from fp8rl_jax.train.run_dir import RunDirError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    checkpoints = run_dir / "checkpoints"
    if shape == "file":
        checkpoints.write_text("")
        needle = f"{checkpoints} exists and is not a directory"
    elif shape == "dangling link":
        checkpoints.symlink_to(tmp_path / "gone")
        needle = (
            f"{checkpoints} is a symbolic link to '{tmp_path / 'gone'}', which does not exist; "
            "create that directory or remove the link"
        )
    else:
        checkpoints.mkdir()
        access = os.access  # root may write anywhere: the mode bits alone would not stop it
        monkeypatch.setattr(
            run_dir_lib.os, "access", lambda p, m: access(p, m) and str(p) != str(checkpoints)
        )
        needle = f"{checkpoints} is not writable by this user"

    def work(*args, **kwargs):
        raise AssertionError("work began before the run directory was checked")

    monkeypatch.setattr(trainer_lib, "build_task", work)  # the trainer's first piece of work
    with pytest.raises(RunDirError) as e:
        trainer_lib.train(experiment_from_config(_config(**{"trainer.run_dir": str(run_dir)})))
    assert str(e.value) == f"trainer.run_dir={str(run_dir)!r}: {needle}"
    assert os.listdir(run_dir) == ["checkpoints"]  # no lock, config, metrics written


def test_jsonl_errors_name_the_line_and_the_real_column(tmp_path):
    from fp8rl_jax.tasks.datasets import MathJsonlDataset

    jsonl = tmp_path / "train.jsonl"
    good = '{"question": "1+1", "answer": 2}\n'
    for bad, where in [
        ('{"question": "2+2", "answer": 4\n', "Expecting ',' delimiter at column 32, the end"),
        ('{"question": "2+2", "answer": 4,}\n', "trailing comma before end of object at column 32"),
        ('{"question": "2+2" "answer": 4}\r\n', "Expecting ',' delimiter at column 20)"),
    ]:
        jsonl.write_text(good + bad, newline="")
        with pytest.raises(ValueError) as e:
            MathJsonlDataset(jsonl)
        assert str(e.value).startswith(f"{jsonl}:2: invalid JSON (") and where in str(e.value)
