"""Checksums of a checkpoint's files: written before the commit, checked before a restore.

Orbax checks the structure of what it reads but not the bytes: its zarr2 chunks carry no
checksum (zarr3 checksums only the shard index), so a same-size bit flip in a data file restores
silently as wrong weights. ``write_manifest`` records the SHA-256 and size of every file of a
step directory (``sha256sum``-compatible digests) in ``CHECKSUMS_FILE``; ``verify_manifest``
recomputes them and raises ``ChecksumError`` naming the first file that differs.

Files are hashed in a thread pool (hashlib releases the GIL on large buffers). Orbax's
``_CHECKPOINT_METADATA`` and ``commit_success.txt`` are left out: the commit rewrites the first
and writes the second after the manifest, and neither holds the state.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

from fp8rl_jax.files import atomic_write_text

CHECKSUMS_FILE = "fp8rl_checksums.json"
_UNHASHED = {CHECKSUMS_FILE, "_CHECKPOINT_METADATA", "commit_success.txt"}  # at the step root
_ALGORITHM = "sha256"
_THREADS = 8


class ChecksumError(RuntimeError):
    """A checkpoint file is missing, has another size, or its bytes differ from the manifest."""


def _files(step_dir: str) -> list[str]:
    """Paths relative to ``step_dir`` of every regular file it holds, sorted."""
    out = []
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel not in _UNHASHED:
                out.append(rel)
    return sorted(out)


def _digest(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, _ALGORITHM).hexdigest()
        return digest, os.fstat(f.fileno()).st_size


def _digests(step_dir: str, rels: list[str]) -> dict[str, tuple[str, int]]:
    paths = [os.path.join(step_dir, rel) for rel in rels]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_THREADS, len(paths)))) as pool:
        return dict(zip(rels, pool.map(_digest, paths)))


def write_manifest(step_dir: str | os.PathLike[str]) -> str:
    """Hashes every file of ``step_dir`` into ``step_dir/CHECKSUMS_FILE``; returns its path."""
    step_dir = os.fspath(step_dir)
    digests = _digests(step_dir, _files(step_dir))
    files = {rel: {"size": size, _ALGORITHM: digest} for rel, (digest, size) in digests.items()}
    path = os.path.join(step_dir, CHECKSUMS_FILE)
    atomic_write_text(path, json.dumps({"algorithm": _ALGORITHM, "files": files}, indent=1))
    return path


def has_manifest(step_dir: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(os.fspath(step_dir), CHECKSUMS_FILE))


def verify_manifest(step_dir: str | os.PathLike[str]) -> None:
    """Raises ``ChecksumError`` naming the file when ``step_dir`` differs from its manifest."""
    step_dir = os.fspath(step_dir)
    path = os.path.join(step_dir, CHECKSUMS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise ChecksumError(f"{path}: unreadable checksum manifest ({e})") from e
    for rel, want in files.items():
        file = os.path.join(step_dir, rel)
        if not os.path.isfile(file):
            raise ChecksumError(f"{file}: listed in {CHECKSUMS_FILE} but missing")
        size = os.path.getsize(file)
        if size != want["size"]:
            raise ChecksumError(f"{file}: {size} bytes, {want['size']} when saved")
    digests = _digests(step_dir, sorted(files))
    for rel, (digest, _) in digests.items():
        if digest != files[rel][_ALGORITHM]:
            raise ChecksumError(
                f"{os.path.join(step_dir, rel)}: {_ALGORITHM} {digest[:16]}... differs from "
                f"{files[rel][_ALGORITHM][:16]}... when saved (same size: the bytes were altered)"
            )
