"""Where an HF export may go, and how it lands there without deleting what it did not write.

Every export writes ``EXPORT_MARKER`` (the files it wrote, and where they came from) beside its
weights. ``plan_target`` looks at the output directory:
  - missing or empty: the export is renamed into place;
  - a previous export (it holds the marker): replaced as a whole; files in it that the previous
    export did not write (a README someone added) are carried over, never deleted;
  - anything else: refused with ``ExportDirError``, unless ``overwrite``: then each exported file
    replaces the file of the same name and nothing else is touched (weight files of another
    checkpoint that would stay beside the new ones are refused: the result would mix both).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from typing import Any, Literal

from fp8rl_jax.files import file_mode

log = logging.getLogger(__name__)

EXPORT_MARKER = "fp8rl_export.json"
Kind = Literal["new", "export", "foreign"]


class ExportDirError(ValueError):
    """The output directory holds files an export must not replace or delete."""


def read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, EXPORT_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), list) else None


def plan_target(path: str, overwrite: bool) -> Kind:
    """How an export may be written to ``path``; raises ``ExportDirError`` when it may not."""
    if not os.path.exists(path):
        return "new"
    if not os.path.isdir(path):
        raise ExportDirError(f"{path} exists and is not a directory")
    if not os.listdir(path):
        return "new"
    if read_marker(path) is not None:
        return "export"
    if overwrite:
        return "foreign"
    raise ExportDirError(
        f"{path} is not empty and is not a previous export (no {EXPORT_MARKER}): nothing was "
        "written. Choose a new directory, or pass --overwrite to write into it (files of the "
        "same names are replaced, nothing else is deleted)"
    )


def sibling(path: str, tag: str) -> str:
    """A fresh hidden name next to ``path`` (same file system, so renames are atomic)."""
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}.{tag}-{uuid.uuid4().hex[:8]}")


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def _replace_export(tmp: str, path: str, written: set[str]) -> None:
    old_files = set(read_marker(path)["files"])
    foreign = [name for name in os.listdir(path) if name not in old_files]
    clash = sorted(set(foreign) & written)
    if clash:
        raise ExportDirError(
            f"{path}: {clash} were not written by the previous export and would be replaced; "
            "move them away first"
        )
    for name in foreign:  # carried over into the new export before the swap
        os.rename(os.path.join(path, name), os.path.join(tmp, name))
    old = sibling(path, "old")
    os.rename(path, old)
    os.rename(tmp, path)
    left = [name for name in os.listdir(old) if name not in old_files]
    if left:  # appeared during the swap: keep them where they are
        log.warning("kept %s: it holds %s, which the previous export did not write", old, left)
        return
    shutil.rmtree(old)


def _merge_into(tmp: str, path: str, written: set[str]) -> None:
    stale = sorted(n for n in os.listdir(path) if _is_weight_file(n) and n not in written)
    if stale:
        raise ExportDirError(
            f"{path}: weight files {stale[:4]} of another checkpoint would stay beside the "
            "export, which would mix both; move them away first (nothing was written)"
        )
    for name in sorted(written - {EXPORT_MARKER}) + [EXPORT_MARKER]:  # the marker last
        os.replace(os.path.join(tmp, name), os.path.join(path, name))
    os.rmdir(tmp)


def commit(tmp: str, path: str, kind: Kind, info: dict[str, Any] | None = None) -> None:
    """Writes the marker into the finished export ``tmp`` and moves it to ``path``.

    Every file gets the umask's mode (safetensors writes its files 0600).
    """
    written = set(os.listdir(tmp)) | {EXPORT_MARKER}
    marker = {"format": "fp8rl_jax HF export", **(info or {}), "files": sorted(written)}
    with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
    for name in written:
        os.chmod(os.path.join(tmp, name), file_mode())
    if kind == "new":
        if os.path.isdir(path):
            os.rmdir(path)  # empty: nothing is lost
        os.rename(tmp, path)
    elif kind == "export":
        _replace_export(tmp, path, written)
    else:
        _merge_into(tmp, path, written)


@contextlib.contextmanager
def staged(path: str, overwrite: bool, info: dict[str, Any] | None = None):
    """Yields a fresh sibling directory to write an export into; on success ``commit`` moves it
    to ``path`` (checked by ``plan_target`` first), on any error it is removed."""
    kind = plan_target(path, overwrite)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = sibling(path, "tmp")
    os.makedirs(tmp)
    try:
        yield tmp
        commit(tmp, path, kind, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
