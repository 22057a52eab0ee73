"""Reader leases on checkpoint step directories, so a trainer's clean-up never deletes what an
export (or any other reader) is reading.

A reader holds a shared ``flock`` on the step directory itself (``reading``): nothing is written
into the run directory, a read-only user can take it, and the kernel drops it when the reader
dies, so no lease outlives its process. The trainer removes an old step only under an exclusive
``flock`` taken without waiting (``remove_unleased``): a leased step is kept until a later
clean-up finds it free. The removal renames the step away (atomic) before deleting its files, so
a reader either holds the lease on the step as it was or finds it gone (``Vanished``) and looks
again; it never reads a half-deleted step. Where the file system has no ``flock`` (some network
mounts), leases are skipped and a reader that loses its step to a clean-up retries on the newest.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

# Orbax removes directories named like an unfinished save (``<step>.orbax-checkpoint-tmp...``)
# when a manager starts, so a clean-up cut short by a crash leaves nothing behind for long.
_TRASH = ".orbax-checkpoint-tmp-removed-"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


class Vanished(RuntimeError):
    """The step directory was removed (by a trainer's clean-up) before or while it was read."""


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise Vanished(f"{path} was removed") from None


@contextlib.contextmanager
def reading(step_dir: str) -> Iterator[None]:
    """Holds a shared lease on ``step_dir`` for the block; ``Vanished`` if it is gone."""
    fd = _open_dir(step_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a clean-up renames it away
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            log.debug("%s: no flock on this file system; reading without a lease", step_dir)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(step_dir))
        except FileNotFoundError:
            same = False
        if not same:
            raise Vanished(f"{step_dir} was removed")
        yield
    finally:
        os.close(fd)


def remove_unleased(step_dir: str) -> bool:
    """Removes ``step_dir`` unless a reader holds a lease on it; returns whether it was removed
    (True also when it was already gone)."""
    try:
        fd = _open_dir(step_dir)
    except Vanished:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
        trash = f"{step_dir}{_TRASH}{time.time_ns()}"
        os.rename(step_dir, trash)  # under the lock: a waiting reader then sees it gone
    finally:
        os.close(fd)
    shutil.rmtree(trash, onexc=lambda *a: log.warning("removing %s: %s", trash, a[2]))
    return True
