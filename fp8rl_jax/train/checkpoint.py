"""Resumable orbax checkpoints: a pytree state plus JSON metadata, the last N kept, checksummed.

Atomicity: orbax (0.11+, AtomicityMode.ATOMIC_RENAME, forced here) writes step `s` into
`<dir>/s.orbax-checkpoint-tmp`, writes `commit_success.txt` last, and only then renames the
directory to `<dir>/s`. A process killed mid-save leaves at most a tmp directory, which the step
listing ignores and the next manager removes (`cleanup_tmp_directories`). Keep-N deletes old
steps only after the new one is committed.

Integrity: just before the rename, process 0 records the SHA-256 of every file of the step
(`integrity.write_manifest`, orbax's `post_finalization_callback`); `restore` checks them first.
A checkpoint that fails the check or does not read is moved aside to `<step>.corrupt-<ns>` with a
warning by `restore_latest`, which then restores the previous one. An interruption is not damage:
a `shutdown.Interrupted` (SIGINT / SIGTERM) raised during a restore propagates at once, and every
checkpoint stays in place.

Readers beside a trainer (`lease`): `restore_latest` holds a shared lease on the step it reads,
and keep-N (done here, not by orbax) removes only steps no reader holds, so an export never loses
its checkpoint to the trainer's clean-up; a leased old step is removed by a later clean-up. A step
removed before its lease was taken, or an empty step listing that raced a save (orbax lists,
then checks each entry), is looked for again, up to `_TRIES` times.

Async: `save` returns once device arrays are copied to host (the caller may donate or overwrite
the state right after); files are written in a background thread. `wait_until_finished` blocks
and raises `CheckpointSaveError` if that save failed. Step directories are created in `save`
itself (orbax's asynchronous creation leaves its writer threads waiting 20 minutes for a
directory that failed to appear, which held the process at exit). `close` always releases
orbax's threads; the trainer calls it on every exit path.

Typed PRNG keys are stored as `jax.random.key_data` (uint32) and re-wrapped on restore with the
implementation recorded in the metadata.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import options as ocp_options

from fp8rl_jax.train import distributed as dist
from fp8rl_jax.train.integrity import (
    CHECKSUMS_FILE,
    ChecksumError,
    has_manifest,
    verify_manifest,
    write_manifest,
)
from fp8rl_jax.train.lease import Vanished, reading, remove_unleased
from fp8rl_jax.train.shutdown import Interrupted

_STATE = "state"
_META = "meta"


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its step, the state pytree, and the user metadata dict.

    Unpacks as `state, metadata = restored`.
    """

    step: int
    state: Any
    metadata: dict[str, Any]

    def __iter__(self):
        return iter((self.state, self.metadata))


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(state: Any) -> tuple[Any, dict[str, str]]:
    """Replaces typed PRNG key leaves by their raw uint32 data; returns {leaf path: impl name}."""
    impls = {}

    def convert(path, x):
        if _is_key(x):
            impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
            return jax.random.key_data(x)
        return x

    return jax.tree_util.tree_map_with_path(convert, state), impls


def _abstract_leaf(x: Any) -> Any:
    """The restore target of one leaf: typed keys become the ShapeDtypeStruct of their data."""
    if not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return x  # numpy arrays and python scalars restore as themselves
    sharding = getattr(x, "sharding", None)
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _data_to_keys(restored: Any, abstract_state: Any, impls: Mapping[str, str]) -> Any:
    def convert(path, target, x):
        if not _is_key(target):
            return x
        name = jax.tree_util.keystr(path)
        if name not in impls:
            raise ValueError(f"checkpoint has no PRNG implementation recorded for {name}")
        return jax.random.wrap_key_data(x, impl=impls[name])

    return jax.tree_util.tree_map_with_path(convert, abstract_state, restored)


def _dotted(path: tuple) -> str:
    """A pytree path as orbax names the array ("params.layers.0.attn.q_norm")."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (the message names the step, directory and cause)."""


class NoCheckpointRestored(RuntimeError):
    """Checkpoints exist but none restores (each one's error is listed)."""


def _interruption(e: BaseException) -> Interrupted | None:
    """The ``Interrupted`` that ``e`` is or was raised from (orbax may wrap it), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, Interrupted):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


_TRIES = 5  # restore_latest: listings of the steps when a trainer removes the one being read


def _listed(list_steps):
    """Runs orbax's step listing (``list_steps()``), again when a step it lists is removed
    meanwhile by a trainer's clean-up (orbax then raises FileNotFoundError, or
    NotADirectoryError when the step went between its ``exists()`` and ``is_dir()`` checks)."""
    for _ in range(_TRIES - 1):
        try:
            return list_steps()
        except (FileNotFoundError, NotADirectoryError):
            continue
    return list_steps()


_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step being written (atomicity_types)
_READ_ONLY = ocp.CheckpointManagerOptions(  # what orbax's read_only implies, set (no warnings)
    read_only=True,
    create=False,
    cleanup_tmp_directories=False,  # a running trainer's in-flight save lives in such a dir
    max_to_keep=None,
    save_interval_steps=0,
)


class CheckpointManager:
    """Saves `(state pytree, JSON metadata)` per step under `directory`, keeping the last N."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        read_only: bool = False,
    ):
        """``read_only``: restore only; nothing in ``directory`` is created, cleaned up, moved
        or deleted (a reader beside a running trainer, e.g. an export)."""
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.async_save, self.read_only = async_save, read_only
        self.max_to_keep = max_to_keep  # keep-N is `_prune`'s (it respects reader leases)
        self._saving: int | None = None  # the step whose save is in flight
        options = (
            _READ_ONLY
            if read_only
            else ocp.CheckpointManagerOptions(
                max_to_keep=None,  # `_prune` removes old steps: orbax would ignore leases
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=True,  # the checksum callback needs the async path
                cleanup_tmp_directories=True,
                atomicity_options=ocp_options.AtomicityOptions(
                    mode=ocp_options.AtomicityMode.ATOMIC_RENAME
                ),
                async_options=ocp.AsyncOptions(
                    post_finalization_callback=self._write_checksums,
                    create_directories_asynchronously=False,
                ),
            )
        )
        self._manager = _listed(
            lambda: ocp.CheckpointManager(
                self.directory, options=options, item_names=(_STATE, _META)
            )
        )

    def _write_checksums(self) -> None:
        """Orbax calls this on process 0 once step `_saving` is written, before its rename."""
        write_manifest(os.path.join(self.directory, f"{self._saving}{_TMP_SUFFIX}"))

    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Starts saving `state` and JSON-able `metadata` (data position, ...) as `step`.

        Returns False when skipped by `save_interval_steps` (or `step` is not past the latest).
        Raises `CheckpointSaveError` if this save or the previous one failed.
        """
        self.wait_until_finished()  # the previous save's callback still reads `_saving`
        plain_state, impls = _keys_to_data(state)
        meta = {"step": int(step), "user": dict(metadata or {}), "prng_impls": impls}
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(plain_state), _META: ocp.args.JsonSave(meta)}
        )
        self._saving = int(step)
        try:
            saved = self._manager.save(int(step), args=args, force=force)
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many error types)
            raise self._save_error(e) from e
        if not self.async_save:
            self.wait_until_finished()
        return saved

    def _save_error(self, e: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"saving checkpoint step {self._saving} to {self.directory} failed: "
            f"{type(e).__name__}: {e}"
        )

    def restore(self, step: int, abstract_state: Any) -> Restored:
        """Restores `step` into the structure, shapes, dtypes and shardings of `abstract_state`
        (concrete arrays or `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape`).

        Raises ValueError naming the first array stored with another shape, then
        `integrity.ChecksumError` if a file differs from its recorded checksum, before any read.
        """
        target = jax.tree.map(_abstract_leaf, abstract_state)
        self._check_shapes(int(step), target)
        self._verify(int(step))
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardRestore(target), _META: ocp.args.JsonRestore()}
        )
        restored = self._manager.restore(int(step), args=args)
        meta = restored[_META]
        state = _data_to_keys(restored[_STATE], abstract_state, meta["prng_impls"])
        return Restored(step=int(step), state=state, metadata=meta["user"])

    def _check_shapes(self, step: int, target: Any) -> None:
        """Raises ValueError naming the first array whose stored shape differs from ``target``'s
        (another model size): before any read, so no orbax read fails half-way."""
        handler = ocp.StandardCheckpointHandler()
        try:  # the manager's item_metadata needs a handler registered by an earlier call
            stored = handler.metadata(epath.Path(self.directory) / str(step) / _STATE)
        except Exception:
            self._verify(step)  # damaged metadata: name the altered file, not orbax's parse error
            raise
        finally:
            handler.close()
        stored = getattr(stored, "tree", stored)
        shapes = {
            _dotted(path): tuple(m.shape)
            for path, m in jax.tree_util.tree_flatten_with_path(stored)[0]
            if hasattr(m, "shape")
        }
        for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
            name = _dotted(path)
            if hasattr(leaf, "shape") and name in shapes and shapes[name] != tuple(leaf.shape):
                raise ValueError(
                    f"{name}: stored shape {shapes[name]}, this config expects {tuple(leaf.shape)}"
                )

    def _verify(self, step: int) -> None:
        """Process 0 checks the step's checksums; every process raises the same error."""
        step_dir = os.path.join(self.directory, str(step))
        problem = ""
        if jax.process_index() == 0:
            if not has_manifest(step_dir):
                logging.warning(
                    "checkpoint %s has no %s (saved by an older version): not verified",
                    step_dir,
                    CHECKSUMS_FILE,
                )
            else:
                try:
                    verify_manifest(step_dir)
                except ChecksumError as e:
                    problem = str(e)
        problem = dist.broadcast_text(problem)
        if problem:
            raise ChecksumError(problem)

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """Restores the newest readable checkpoint; None if there is none at all.

        A newer checkpoint that is unreadable or fails its checksums is reported with
        `logging.warning` and moved aside to `<step>.corrupt-<ns>` once an older one restores,
        so later saves of that step succeed. Raises `NoCheckpointRestored` if checkpoints exist
        but none restores (e.g. a wrong abstract_state); then nothing is moved. An `Interrupted`
        raised during a restore propagates at once (nothing is moved). Each step is read under a
        reader lease; a step a trainer removed meanwhile sends the search back to the newest.
        """
        self._wait()  # no clean-up first: the older steps are the fallbacks
        for _ in range(_TRIES):
            _listed(self._manager.reload)
            steps = sorted(self._manager.all_steps(), reverse=True)
            if not steps and self._has_step_dirs():
                # orbax lists the directory, then checks each entry: a trainer that renamed
                # step n + 1 into place after the listing and removed step n before its check
                # leaves an empty listing although a committed step exists. List again.
                logging.warning("the step listing of %s raced a save; again", self.directory)
                continue
            try:
                return self._restore_newest(steps, abstract_state)
            except Vanished as e:
                logging.warning("%s; looking for the newest checkpoint again", e)
        raise NoCheckpointRestored(
            f"the checkpoints under {self.directory} were removed while being read, {_TRIES} "
            "times: is a trainer saving with trainer.keep_checkpoints=1 on a file system "
            "without flock? Export from a copy of the run's checkpoints"
        )

    def _has_step_dirs(self) -> bool:
        """Whether a committed step directory (named by its number) exists right now."""
        try:
            return any(e.name.isdigit() and e.is_dir() for e in os.scandir(self.directory))
        except OSError:
            return False

    def _restore_newest(self, steps: list[int], abstract_state: Any) -> Restored | None:
        failures = []
        for step in steps:
            path = os.path.join(self.directory, str(step))
            try:
                with reading(path):
                    restored = self.restore(step, abstract_state)
            except Vanished:
                raise
            except Exception as e:  # noqa: BLE001 (orbax/tensorstore raise many error types)
                if (interrupted := _interruption(e)) is not None:
                    raise interrupted from None  # a signal, not damage: nothing is moved
                if not os.path.isdir(path):  # removed mid-read (no flock here): not damage
                    raise Vanished(f"{path} was removed while being read") from e
                logging.warning(
                    "checkpoint %s is damaged or unreadable (%s: %s); trying an older one",
                    path,
                    type(e).__name__,
                    e,
                )
                failures.append(f"{path}: {type(e).__name__}: {e}")
                continue
            if not self.read_only:
                self._quarantine([s for s in steps if s > step])
            return restored
        if failures:
            raise NoCheckpointRestored(
                f"no checkpoint under {self.directory} could be restored:\n" + "\n".join(failures)
            )
        return None

    def _quarantine(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                src = os.path.join(self.directory, str(step))
                dst = f"{src}.corrupt-{time.time_ns()}"
                logging.warning("moving damaged or unreadable checkpoint %s to %s", src, dst)
                os.rename(src, dst)
        dist.sync("checkpoint_quarantine")
        self._manager.reload()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def wait_until_finished(self) -> None:
        """Blocks until the last asynchronous save is committed; raises `CheckpointSaveError`
        if it failed (once: the next call returns)."""
        self._wait()
        self._prune()

    def _wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_error(e) from e

    def _prune(self) -> None:
        """Keep-N: removes the committed steps older than the newest ``max_to_keep`` that no
        reader holds (process 0; a leased one waits for a later call)."""
        if self.read_only or jax.process_index() != 0:
            return
        old = sorted(self._manager.all_steps())[: -self.max_to_keep]
        removed = [s for s in old if self._remove(s)]
        if removed:
            self._manager.reload()
        if len(removed) < len(old):
            logging.info(
                "keeping checkpoints %s while a reader holds them", sorted(set(old) - set(removed))
            )

    def _remove(self, step: int) -> bool:
        path = os.path.join(self.directory, str(step))
        try:
            return remove_unleased(path)
        except OSError as e:  # a clean-up failure must not stop training: retried next time
            logging.warning("could not remove old checkpoint %s: %s", path, e)
            return False

    def close(self) -> None:
        """Waits for the pending save, then releases orbax's background threads, even when the
        save failed (its `CheckpointSaveError` is raised after the release)."""
        try:
            self.wait_until_finished()
        finally:
            self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
