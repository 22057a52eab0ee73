"""Writing run files: atomically, and readable as the umask allows (0644 under umask 022).

``tempfile.mkstemp`` creates files 0600 whatever the umask, so a file renamed into place from it
is unreadable to the other users of a shared cluster account or group. ``atomic_write_text``
gives the file the mode a plain ``open(path, "w")`` would (0666 minus the umask) before the
rename.
"""

from __future__ import annotations

import os
import tempfile
import threading

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where Linux exposes it (/proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:  # elsewhere: set and restore it (process-wide, so under a lock)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 minus the umask."""
    return 0o666 & ~current_umask()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Writes ``text`` to a sibling temporary file, fsyncs it and renames it over ``path``."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
