"""Orbax checkpoints: exact round trip with typed keys, keep-N, fallback from a damaged latest."""

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.train import CheckpointManager


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    params: dict
    step: jax.Array
    rng: jax.Array  # typed PRNG key
    tag: str = dataclasses.field(default="tiny", metadata=dict(static=True))


def _state(seed: int) -> _State:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w_DF": jax.random.normal(k1, (8, 16), jnp.float32),
        "embed_VD": jax.random.normal(k2, (32, 8)).astype(jnp.bfloat16),
    }
    return _State(params=params, step=jnp.int32(seed), rng=jax.random.key(seed + 100))


def _assert_same(a: _State, b: _State) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert int(a.step) == int(b.step)
    assert b.rng.dtype == a.rng.dtype
    np.testing.assert_array_equal(jax.random.key_data(a.rng), jax.random.key_data(b.rng))


def _save_steps(directory, steps, max_to_keep=3):
    with CheckpointManager(directory, max_to_keep=max_to_keep) as mgr:
        for s in steps:
            assert mgr.save(s, _state(s), {"data_position": 10 * s})
        mgr.wait_until_finished()


def test_round_trip_is_exact_with_typed_keys_and_metadata(tmp_path):
    _save_steps(tmp_path, [0, 1])
    abstract = jax.eval_shape(lambda: _state(0))
    with CheckpointManager(tmp_path) as mgr:
        restored = mgr.restore_latest(abstract)
        assert restored.step == 1 and restored.metadata == {"data_position": 10}
        _assert_same(_state(1), restored.state)
        # The restored key behaves like the original one.
        np.testing.assert_array_equal(
            jax.random.uniform(restored.state.rng, (3,)), jax.random.uniform(_state(1).rng, (3,))
        )
        # Concrete arrays work as the abstract state too.
        _assert_same(_state(0), mgr.restore(0, _state(5)).state)


def test_none_when_empty(tmp_path):
    with CheckpointManager(tmp_path / "empty") as mgr:
        assert mgr.restore_latest(jax.eval_shape(lambda: _state(0))) is None


def test_keeps_last_n(tmp_path):
    _save_steps(tmp_path, range(5), max_to_keep=2)
    with CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]


def _damage(step_dir):
    """Truncates every data file of the state item (a torn copy or a bad disk)."""
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            if "manifest" in name or root.endswith(os.sep + "d"):
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(0)


def test_damaged_latest_falls_back_with_warning(tmp_path, caplog):
    _save_steps(tmp_path, [1, 2, 3])
    _damage(tmp_path / "3")
    abstract = jax.eval_shape(lambda: _state(0))
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path) as mgr:
        restored = mgr.restore_latest(abstract)
        assert restored.step == 2
        _assert_same(_state(2), restored.state)
        assert any(str(tmp_path / "3") in r.getMessage() for r in caplog.records)
        # The damaged step is moved aside, so the resumed run can save step 3 again.
        assert mgr.all_steps() == [1, 2]
        assert mgr.save(3, _state(30), {"data_position": 0})
        mgr.wait_until_finished()
        _assert_same(_state(30), mgr.restore_latest(abstract).state)
    assert any(name.startswith("3.corrupt-") for name in os.listdir(tmp_path))


def test_deleted_item_falls_back(tmp_path):
    _save_steps(tmp_path, [1, 2])
    os.remove(tmp_path / "2" / "meta" / "metadata")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(jax.eval_shape(lambda: _state(0))).step == 1


def test_all_unreadable_raises(tmp_path):
    _save_steps(tmp_path, [1])
    wrong = jax.eval_shape(lambda: dataclasses.replace(_state(0), params={"other": jnp.zeros(3)}))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(RuntimeError, match="could be restored"):
        mgr.restore_latest(wrong)


def test_another_shape_is_named_before_any_read(tmp_path):
    _save_steps(tmp_path, [1])
    params = {"w_DF": jnp.zeros((8, 17)), "embed_VD": jnp.zeros((32, 8), jnp.bfloat16)}
    wrong = jax.eval_shape(lambda: dataclasses.replace(_state(0), params=params))
    match = r"^params.w_DF: stored shape \(8, 16\), this config expects \(8, 17\)$"
    with CheckpointManager(tmp_path, read_only=True) as mgr, pytest.raises(ValueError, match=match):
        mgr.restore(1, wrong)  # a fresh manager: no handler registered by an earlier save


def test_leftover_tmp_dir_is_ignored(tmp_path):
    _save_steps(tmp_path, [1])
    leftover = tmp_path / "7.orbax-checkpoint-tmp-1234567"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "garbage").write_bytes(b"\0" * 10)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 1
        assert mgr.restore_latest(jax.eval_shape(lambda: _state(0))).step == 1


_SAVER = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp
    from fp8rl_jax.train import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], max_to_keep=2)
    big = jnp.ones((1024, 1024), jnp.float32)  # 4 MiB: a save takes long enough to be cut
    for step in range(10_000):
        state = {"big": big * step, "rng": jax.random.key(step)}
        mgr.save(step, state, {"data_position": step})
        print(step, flush=True)
    """
)


def test_sigkill_mid_save_leaves_a_restorable_checkpoint(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    saw_tmp_dir = False
    try:
        started = 0
        while started < 5:  # a few committed saves first
            line = proc.stdout.readline()
            if not line:
                break
            started = int(line) + 1
        deadline = time.time() + 10
        while not saw_tmp_dir and time.time() < deadline:  # then kill while a save is in flight
            saw_tmp_dir = any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert started >= 5, "saver did not start"
    assert saw_tmp_dir
    abstract = {"big": jax.ShapeDtypeStruct((1024, 1024), jnp.float32), "rng": jax.random.key(0)}
    with CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        restored = mgr.restore_latest(abstract)
    assert restored is not None
    step = restored.step
    assert restored.metadata == {"data_position": step}
    np.testing.assert_array_equal(restored.state["big"], np.full((1024, 1024), step, np.float32))
    np.testing.assert_array_equal(
        jax.random.key_data(restored.state["rng"]), jax.random.key_data(jax.random.key(step))
    )


def test_restored_unpacks_as_state_and_metadata(tmp_path):
    _save_steps(tmp_path, [4])
    with CheckpointManager(tmp_path) as mgr:
        state, metadata = mgr.restore_latest(jax.eval_shape(lambda: _state(0)))
    _assert_same(_state(4), state)
    assert metadata == {"data_position": 40}


# Issue 25: an interrupted restore is no damage; readers beside a trainer's clean-up -------------


def _committed(directory) -> list[str]:
    return sorted(os.listdir(directory))


def _interrupt(*args, **kwargs):
    from fp8rl_jax.train.shutdown import Interrupted

    raise Interrupted("stopped by SIGINT before the first RL step: nothing to save", signal.SIGINT)


def _wrapped_interrupt(*args, **kwargs):
    try:  # as a library that catches and re-raises (orbax's asyncio layers) would pass it on
        _interrupt()
    except RuntimeError as e:
        raise ValueError("restore failed") from e


def _once(raiser, original):
    """``raiser`` on the first call (the newest step: Ctrl-C comes once), then ``original``."""
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        return raiser() if len(calls) == 1 else original(*args, **kwargs)

    return call


@pytest.mark.parametrize("where", ["reading the checksums", "reading the arrays in orbax"])
def test_an_interrupted_restore_moves_nothing_and_propagates(tmp_path, monkeypatch, where):
    import orbax.checkpoint as ocp

    import fp8rl_jax.train.checkpoint as checkpoint_lib
    from fp8rl_jax.train.shutdown import Interrupted

    _save_steps(tmp_path, [1, 2])
    before = _committed(tmp_path)
    if where == "reading the checksums":
        target, name, raiser = checkpoint_lib, "verify_manifest", _interrupt
    else:
        target, name, raiser = ocp.CheckpointManager, "restore", _wrapped_interrupt
    monkeypatch.setattr(target, name, _once(raiser, getattr(target, name)))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(Interrupted) as e:
        mgr.restore_latest(jax.eval_shape(lambda: _state(0)))
    assert e.value.exit_code == 130
    assert _committed(tmp_path) == before == ["1", "2"]  # nothing moved aside as damaged


def test_keep_n_keeps_a_step_a_reader_holds_until_it_is_released(tmp_path):
    from fp8rl_jax.train.lease import reading

    with CheckpointManager(tmp_path, max_to_keep=1) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_until_finished()
        with reading(str(tmp_path / "1")):  # an export reading step 1
            mgr.save(2, _state(2))
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2]  # kept while it is read
            mgr.save(3, _state(3))
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 3]
        mgr.save(4, _state(4))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4]
    assert _committed(tmp_path) == ["4"]  # nothing left behind by the removals


@pytest.mark.parametrize("leases", [True, False])
def test_a_reader_survives_the_trainer_removing_its_step_mid_read(tmp_path, monkeypatch, leases):
    """keep_checkpoints=1 and a save while the export reads: with leases (flock) the export
    reads the step it chose; without (a file system without flock) it reads the next newest."""
    import fp8rl_jax.train.checkpoint as checkpoint_lib

    if not leases:
        monkeypatch.setattr(checkpoint_lib, "reading", lambda path: _no_lease())
    trainer = CheckpointManager(tmp_path, max_to_keep=1)
    trainer.save(1, _state(1))
    trainer.wait_until_finished()
    verify, saved = checkpoint_lib.verify_manifest, []

    def verify_while_the_trainer_saves(step_dir):
        if not saved:  # the first read: the trainer commits step 2 and cleans up meanwhile
            saved.append(trainer.save(2, _state(2)))
            trainer.wait_until_finished()
        return verify(step_dir)

    monkeypatch.setattr(checkpoint_lib, "verify_manifest", verify_while_the_trainer_saves)
    with CheckpointManager(tmp_path, read_only=True) as reader:
        restored = reader.restore_latest(jax.eval_shape(lambda: _state(0)))
    trainer.save(3, _state(3))
    trainer.close()
    assert saved == [True]
    assert restored.step == (1 if leases else 2)
    _assert_same(_state(restored.step), restored.state)
    assert _committed(tmp_path) == ["3"]  # the held step went at the next clean-up


def test_an_empty_step_listing_that_raced_a_save_is_listed_again(tmp_path, monkeypatch, caplog):
    """orbax lists the directory, then checks each entry; a save's rename (step 2 in) and keep-1
    clean-up (step 1 out) between the two leave an empty listing although step 2 is there."""
    with CheckpointManager(tmp_path, max_to_keep=1) as trainer:
        trainer.save(2, _state(2))
    with CheckpointManager(tmp_path, read_only=True) as reader:
        listing = reader._manager.all_steps
        calls = []

        def raced(*args, **kwargs):
            calls.append(1)
            return [] if len(calls) == 1 else listing(*args, **kwargs)

        monkeypatch.setattr(reader._manager, "all_steps", raced)
        with caplog.at_level("WARNING"):
            restored = reader.restore_latest(jax.eval_shape(lambda: _state(0)))
    assert len(calls) == 2
    assert "raced a save" in caplog.text
    assert restored.step == 2
    _assert_same(_state(2), restored.state)


class _no_lease:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_repeated_reads_beside_a_trainer_saving_every_step_with_keep_1(tmp_path):
    """A real race: a writer thread saves every step (keep 1) while the main thread restores."""
    import threading

    stop, saved = threading.Event(), []

    def trainer():
        with CheckpointManager(tmp_path, max_to_keep=1) as mgr:
            step = 1
            while not stop.is_set() or step < 6:
                mgr.save(step, _state(step))
                mgr.wait_until_finished()
                saved.append(step)
                step += 1

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        while not saved:
            time.sleep(0.01)
        steps = []
        with CheckpointManager(tmp_path, read_only=True) as reader:
            for _ in range(12):
                restored = reader.restore_latest(jax.eval_shape(lambda: _state(0)))
                _assert_same(_state(restored.step), restored.state)
                steps.append(restored.step)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert steps == sorted(steps) and len(saved) >= 6
    assert _committed(tmp_path) == [str(saved[-1])]
