"""``train()`` on a mesh (docs/SCALING.md §6) logs what the single-device run logs.

Each run is ``tests.trainer_sharded_worker`` in a subprocess (the fake CPU device count is fixed
when jax is imported), on a tiny config (D=32, 4 prompts x 4 responses), all sharing the test
run's persistent compilation cache (conftest.py). The reference is one uninterrupted 4-step
run on one device.

Numerics: FP8 W8A8 rollout weights (quant on), everything else f32 (rollout compute, KV cache,
SFT, master weights), so a mesh changes only the order of reductions. The sampled tokens are then
the same, and metrics agree to ~1e-6 relative; we allow 1e-4 (relative to 1 + |value|).
SFT uses a high lr and a format reward, so rewards vary within groups and the updates are non-zero.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4
TINY = {
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.intermediate_size": 64,
    "task.format_reward": 0.5,
    "sft.steps": 20,
    "sft.batch_size": 16,
    "sft.optim.lr": 0.01,
    "sft.optim.warmup_steps": 0,
    "rl.group_size": 4,
    "rl.num_minibatches": 2,
    "rollout.compute_dtype": "float32",
    "rollout.kv_cache_dtype": "float32",
    "trainer.prompts_per_step": 4,
    "trainer.eval_size": 16,
    "trainer.eval_every": 2,
    "trainer.checkpoint_every": 2,
    "trainer.plots": "false",
}
WALL_CLOCK = {"rollout_time_s"}


@pytest.fixture(scope="module")
def env():
    """The test run's environment (with its persistent compilation cache), one device by default."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    return env


def _cmd(run_dir, steps: int, *worker_args: str) -> list[str]:
    sets = {**TINY, "trainer.run_dir": str(run_dir), "trainer.steps": steps}
    flags = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "tests.trainer_sharded_worker", *worker_args, *flags]


def _run(env, run_dir, steps: int, *worker_args: str) -> tuple[dict, str]:
    proc = subprocess.run(
        _cmd(run_dir, steps, *worker_args),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def _metrics(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in WALL_CLOCK} for x in lines]


def _assert_close(got: list[dict], want: list[dict]) -> None:
    """Rows of ``got`` equal the same steps of ``want`` on the metrics both logged."""
    assert [r["step"] for r in got] == [r["step"] for r in want[: len(got)]]
    for g, w in zip(got, want):
        for k in g.keys() & w.keys():
            assert abs(g[k] - w[k]) <= TOL * (1 + abs(w[k])), (w["step"], k, g[k], w[k])


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """One uninterrupted 4-step run on one device, one process."""
    run_dir = tmp_path_factory.mktemp("reference")
    summary, _ = _run(env, run_dir, 4)
    assert summary["devices"] == 1
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert any(r.get("grad_norm", 0) > 0 for r in rows)  # the updates do something
    return rows


@pytest.mark.slow
def test_mesh_run_matches_single_device_and_resumes(env, reference, tmp_path):
    mesh = ("--devices", "8", "--mesh", "data=2,fsdp=2,tensor=2")
    first, _ = _run(env, tmp_path, 2, *mesh)
    assert first["devices"] == 8 and first["steps"] == 2
    summary, stdout = _run(env, tmp_path, 4, *mesh)  # resumes from the checkpoint of step 2
    assert "at step 2" in stdout
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _assert_close(rows, reference)
    assert [s for s, _ in summary["eval_accuracy"]] == [0, 2, 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_and_their_checkpoint_resumes_on_one_device(
    env, reference, tmp_path
):
    """Two processes (2 fake devices each, one 4-device mesh) for 3 steps; then one process on
    one device resumes their checkpoint of step 3 and runs step 4 (the trainer's one-device
    placement restores a mesh's checkpoint). The only two-process test:
    the trainer's loop over rows, metrics, evaluation and orbax checkpoints, with
    ``--probe`` spies (trainer_sharded_worker.py) for what the files do not show."""
    port = str(_free_port())
    args = ("--devices", "2", "--mesh", "data=2,fsdp=2", "--num-processes", "2", "--port", port)
    probes = [tmp_path / f"probe{i}.json" for i in range(2)]
    run_dir = tmp_path / "run"
    procs = [
        subprocess.Popen(
            _cmd(run_dir, 3, *args, "--process-id", str(i), "--probe", str(probes[i])),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1][-3000:] for o in outs)
    s0, s1 = (json.loads(o[0].strip().splitlines()[-1]) for o in outs)
    p0, p1 = (json.loads(p.read_text()) for p in probes)
    assert (s0["process_index"], s1["process_index"], s0["devices"]) == (0, 1, 4)
    assert (p0["process_count"], p0["local_devices"], p1["local_devices"]) == (2, 2, 2)
    # Each process fed its own half of every batch (16 rollout rows, 16 eval prompts).
    assert [16, 0, 8] in p0["rows"] and [16, 8, 16] in p1["rows"]
    assert all(n == 16 and hi - lo == 8 for n, lo, hi in p0["rows"] + p1["rows"])
    assert {lo for _, lo, _ in p0["rows"]} == {0} and {lo for _, lo, _ in p1["rows"]} == {8}
    # Both processes computed the same rows (replicated metrics); only process 0 wrote them.
    assert [r["step"] for r in p0["logged"]] == [1, 2, 3] and p0["logged"] == p1["logged"]
    # Every program compiled (or loaded from the cache) by the first save; none after it.
    assert p0["programs_made_after_first_save"] == p1["programs_made_after_first_save"] == 0
    assert p0["saved_step"] == p1["saved_step"] == 3
    # Only process 0 reads and writes metrics.jsonl (both share this run_dir, as on a shared
    # file system); the other one returns a summary without the eval history.
    assert [s for s, _ in s0["eval_accuracy"]] == [0, 2, 3] and "eval_accuracy" not in s1
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    _assert_close(rows, reference)
    _assert_close(p0["logged"], reference[1:])
    assert (run_dir / "checkpoints" / "2").is_dir() and (run_dir / "checkpoints" / "3").is_dir()

    # One process on one device resumes their checkpoint of step 3 exactly and goes on.
    probe = tmp_path / "probe_resume.json"
    summary, stdout = _run(
        env, run_dir, 4, "--devices", "1", "--probe", str(probe), "--written", f"{probes[0]}.npz"
    )  # fmt: skip
    assert (summary["process_index"], summary["devices"]) == (0, 1) and "at step 3" in stdout
    resumed = json.loads(probe.read_text())
    assert resumed["process_count"] == 1 and resumed["restored_devices"] == [1]
    restored_step, max_diff, n_leaves = resumed["restored"]
    assert restored_step == 3 and n_leaves > 0
    assert max_diff == 0.0  # exact round trip: 2 processes, 4 devices -> 1 device
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    _assert_close(rows, reference)
