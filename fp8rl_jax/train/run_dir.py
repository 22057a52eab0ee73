"""Who may write a run directory, and the record of the config it was started with.

The lock: ``run_dir/run.lock``, held with ``fcntl.flock`` on an open file for the life of the
run, names its holder (host, pid, start time, command). A second run on the same directory gets
``RunDirLocked`` naming the first; the kernel drops the lock when its process dies, so a lock
file left by a killed run is taken over with a warning naming the dead holder. Multi-host: only
process 0 takes the lock and writes; every process gets its outcome (``broadcast_text``) and
raises the same error. Where the file system has no ``flock`` (some NFS / Lustre mounts), the
holder named in the file is checked instead: a live process on this host blocks the run.

The config: ``config.json`` is the resolved config of the run's first start and is never
overwritten. ``record_config`` runs after the resume check, so a rerun that cannot resume leaves
it as it was; a rerun with other values is saved as ``config.<n>.json`` with a warning listing
the changed fields. An error that ends a run appends its traceback to ``error.log``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import traceback
from collections.abc import Mapping
from typing import Any

from fp8rl_jax.files import atomic_write_text, file_mode
from fp8rl_jax.train import distributed as dist

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.json"
ERROR_LOG = "error.log"  # tracebacks of the errors that ended runs in this directory
TRACEBACK_ATTR = "fp8rl_traceback_file"  # set on an exception whose traceback was written


class RunDirError(RuntimeError):
    """The run directory cannot be used (not a directory, not writable, locked)."""


class RunDirLocked(RunDirError):
    """Another live process holds the run directory's lock."""


CHECKPOINTS_DIR = "checkpoints"


def prepare_run_dir(run_dir: str) -> str:
    """Creates ``run_dir`` (absolute path returned); raises ``RunDirError`` naming the field.

    It and its ``checkpoints`` (when present) must be writable directories: a regular file, a
    dangling symbolic link or a read-only directory in their place is named here, before any
    work, not by the first save steps later.
    """
    path = os.path.abspath(run_dir)
    where = f"trainer.run_dir={run_dir!r}"
    _check_dir_shape(path, where)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{where}: cannot create {path}: {e.strerror or e}") from e
    _check_writable(path, where)
    checkpoints = os.path.join(path, CHECKPOINTS_DIR)
    _check_dir_shape(checkpoints, where)
    if os.path.isdir(checkpoints):
        _check_writable(checkpoints, where)
    return path


def _check_dir_shape(path: str, where: str) -> None:
    """``path`` is absent or a directory (through links); else one line naming it."""
    if os.path.islink(path) and not os.path.exists(path):
        raise RunDirError(
            f"{where}: {path} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
            "create that directory or remove the link"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"{where}: {path} exists and is not a directory")


def _check_writable(path: str, where: str) -> None:
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"{where}: {path} is not writable by this user")


def _holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:500],
    }


def _describe(holder: Mapping[str, Any]) -> str:
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, "
        f"started {holder.get('started')}: {holder.get('command', '')!r}"
    )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists (another user's)
    return True


def _read_holder(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class RunLock:
    """The exclusive lock of one run directory (process 0's), held until ``release``."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(os.path.abspath(run_dir), LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode())
        try:
            self._lock(fd)
            self._take_over(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _lock(self, fd: int) -> None:
        run_dir = os.path.dirname(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _read_holder(fd) or {}
            raise RunDirLocked(
                f"trainer.run_dir {run_dir} is in use by another run ({_describe(holder)}); "
                "two runs on one run_dir would mix their checkpoints and metrics: wait for it, "
                f"stop it, or choose another run_dir (lock: {self.path})"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        log.warning(
            "%s: the file system does not support flock; checking the holder's pid", run_dir
        )
        holder = _read_holder(fd)
        if holder and holder.get("host") == socket.gethostname() and holder.get("pid"):
            pid = int(holder["pid"])
            if pid != os.getpid() and _alive(pid):
                raise RunDirLocked(
                    f"trainer.run_dir {run_dir} is in use by another run ({_describe(holder)}); "
                    f"choose another run_dir (lock: {self.path})"
                )

    def _take_over(self, fd: int) -> None:
        holder = _read_holder(fd)
        if holder:  # a run that ended without releasing: killed, or its host went down
            here = holder.get("host") == socket.gethostname()
            state = "no longer running" if here and not _alive(int(holder.get("pid", 0))) else ""
            log.warning(
                "taking over the stale lock %s of %s%s",
                self.path,
                _describe(holder),
                f" ({state})" if state else " (it no longer holds the lock)",
            )
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(_holder()) + "\n").encode("utf-8"))
        os.fsync(fd)

    def release(self) -> None:
        """Empties the lock file (a clean exit leaves no stale holder) and unlocks it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the file drops the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(run_dir: str) -> RunLock | None:
    """Process 0 locks ``run_dir``; every process raises ``RunDirError`` if that failed.

    Returns the held lock on process 0, None elsewhere. Call after ``prepare_run_dir``.
    """
    lock, problem = None, ""
    if dist.is_main_process():
        try:
            lock = RunLock(run_dir).acquire()
        except RunDirError as e:
            problem = str(e)
        except OSError as e:
            problem = f"trainer.run_dir {run_dir}: cannot lock {LOCK_FILE}: {e}"
    problem = dist.broadcast_text(problem)
    if problem:
        if lock is not None:
            lock.release()
        raise RunDirLocked(problem)
    return lock


@contextlib.contextmanager
def locked_run_dir(run_dir: str):
    """Process 0 creates and locks ``run_dir``; every process raises the same error otherwise."""
    problem = ""
    if dist.is_main_process():
        try:
            prepare_run_dir(run_dir)
        except RunDirError as e:
            problem = str(e)
    if problem := dist.broadcast_text(problem):
        raise RunDirError(problem)
    lock = lock_run_dir(run_dir)
    try:
        yield
    except Exception as e:
        from fp8rl_jax.train.shutdown import Interrupted

        if lock is not None and not isinstance(e, Interrupted):
            write_traceback(os.path.join(run_dir, ERROR_LOG), e)
        raise
    finally:
        if lock is not None:
            lock.release()


def write_traceback(path: str, error: BaseException) -> None:
    """Appends ``error``'s traceback to ``path``; the exception records the file (the CLI
    names it in its one-line error)."""
    with open(path, "a", encoding="utf-8") as f:
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        f.write(f"--- {stamp} pid {os.getpid()}\n" + "".join(traceback.format_exception(error)))
    setattr(error, TRACEBACK_ATTR, path)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"a.b: old -> new"`` for every leaf field that differs (missing leaves shown as -)."""
    a, b = _flatten(old), _flatten(new)
    return [
        f"{k}: {json.dumps(a.get(k, '-'))} -> {json.dumps(b.get(k, '-'))}"
        for k in sorted(set(a) | set(b))
        if a.get(k, "-") != b.get(k, "-")
    ]


def read_config(run_dir: str) -> dict[str, Any] | None:
    """The run's ``config.json``, or None when there is none (or it does not parse)."""
    try:
        with open(os.path.join(run_dir, CONFIG_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def record_config(run_dir: str, config: Mapping[str, Any]) -> str:
    """Writes ``config.json`` once; a different config goes to ``config.<n>.json`` (warned).

    ``config`` is the JSON form (``logging.jsonable``) of the resolved config. Returns the path
    that holds it. Call on process 0 only, after the resume check.
    """
    path = os.path.join(run_dir, CONFIG_FILE)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    old = read_config(run_dir)
    if old is None and not os.path.exists(path):
        atomic_write_text(path, text)
        return path
    if old == json.loads(text):
        return path
    n = 1
    while os.path.exists(os.path.join(run_dir, f"config.{n}.json")):
        n += 1
    new_path = os.path.join(run_dir, f"config.{n}.json")
    atomic_write_text(new_path, text)
    changes = config_changes(old or {}, json.loads(text))
    log.warning(
        "the config differs from %s (kept as the run's original), saved as %s; changed: %s",
        path,
        new_path,
        "; ".join(changes) if changes else "(config.json does not parse)",
    )
    return new_path
