"""HF checkpoints (config.json + safetensors, sharded or not) <-> the weights pytree, without torch.

Loading reads one shard at a time through ``safe_open`` (memory-mapped), converts each tensor to
the target dtype and moves it to the device before the next, so the host never holds two full
copies. Stacked experts are assembled one layer at a time. MoE experts may be stored per expert
(``mlp.experts.{e}.gate_proj.weight``, the Qwen3-MoE release layout, which is what we save) or
fused (``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj`` [E, D, F], the
transformers v5 in-memory layout).
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.hf import dir as hf_dir
from fp8rl_jax.models.hf import fp8 as hf_fp8
from fp8rl_jax.models.hf.layout import (
    _IGNORED,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    _Entry,
    _get,
    _open_shard,
    _shard_files,
    _tensor_files,
    copy_tokenizer_files,
    hf_entries,
    with_special_tokens,
)
from kernels_pallas.qarray import QArray


def _check_names(entries: dict[str, _Entry], files: dict[str, str], cfg: ModelConfig) -> None:
    present = {n for n in files if not _IGNORED.search(n)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store it anyway
    missing = sorted(set(entries) - present)
    extra = sorted(present - set(entries))
    if missing:
        raise CheckpointError(f"missing tensor(s) for {cfg.architecture}: {missing[:8]}")
    if extra:
        where = [f"{n} (in {files[n]})" for n in extra[:8]]
        raise CheckpointError(f"unexpected extra tensor(s): {where}")


class _Assembler:
    """Puts converted tensors into the pytree; stacks experts and moves each stack when full."""

    def __init__(self, cfg: ModelConfig, dtype):
        self.cfg, self.np_dtype, self.dtype = cfg, np.dtype(dtype), dtype
        self.tree: dict = {"layers": [{"attn": {}, "mlp": {}} for _ in range(cfg.num_layers)]}
        self.stacks: dict[tuple, tuple[np.ndarray, int]] = {}

    def _put(self, path: tuple, arr: np.ndarray) -> None:
        node = self.tree
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = jnp.asarray(arr.astype(self.np_dtype, copy=False), self.dtype)

    def _put_expert(self, path: tuple, e: int, arr: np.ndarray) -> None:
        E = self.cfg.num_experts
        buf, n = self.stacks.get(path, (None, 0))
        if buf is None:
            buf = np.empty((E, *arr.shape), self.np_dtype)
        buf[e] = arr
        if n + 1 == E:
            self.stacks.pop(path, None)
            self._put(path, buf)
        else:
            self.stacks[path] = (buf, n + 1)

    def add(self, entry: _Entry, arr: np.ndarray) -> None:
        if entry.kind == "plain":
            self._put(entry.path, arr)
        elif entry.kind in ("linear", "fused_down"):
            self._put(entry.path, np.swapaxes(arr, -1, -2))
        elif entry.kind == "expert":
            self._put_expert(entry.path, entry.expert, arr.T)
        elif entry.kind == "fused_gate_up":
            gate, up = np.split(np.swapaxes(arr, -1, -2), 2, axis=-1)
            self._put((*entry.path, "w_gate"), gate)
            self._put((*entry.path, "w_up"), up)


def load_hf_checkpoint(
    path, *, dtype=jnp.bfloat16, check_finite: bool = True
) -> tuple[ModelConfig, dict]:
    """(config, weights) from a local HF directory; tensors converted to ``dtype``.

    Raises ``CheckpointError`` naming the file or tensor for an unreadable shard, a missing,
    extra or misshapen tensor, and (``check_finite``) NaN/Inf values after the conversion.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if hf_fp8.is_fp8_checkpoint(path):  # a block-FP8 export: dequantized to training weights
        return hf_fp8.load_fp8_checkpoint(path, dtype=dtype, dequantize=True)
    cfg = ModelConfig.from_hf_config(path)
    shards = _shard_files(path)
    files = _tensor_files(path, shards)
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in files)
    entries = hf_entries(cfg, fused_experts=fused)
    _check_names(entries, files, cfg)
    out = _Assembler(cfg, dtype)
    for shard in shards:
        with _open_shard(os.path.join(path, shard)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                entry = entries.get(name)
                if entry is None:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != entry.hf_shape:
                    raise CheckpointError(
                        f"shape mismatch for {name} in {shard}: got {shape}, "
                        f"expected {entry.hf_shape} from config.json"
                    )
                out.add(entry, f.get_tensor(name))
    if check_finite:
        _check_finite(path, out.tree, entries, files)
    return cfg, out.tree


@jax.jit
def _nonfinite_counts(tree) -> jax.Array:
    """[n_leaves] int32: NaN/Inf values per leaf (one device pass, one small transfer)."""
    leaves = jax.tree.leaves(tree)
    return jnp.stack([jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in leaves])


def _check_finite(path: str, tree: dict, entries: dict[str, _Entry], files: dict[str, str]):
    """Raises ``CheckpointError`` naming every tensor with NaN/Inf values (and its file)."""
    counts = np.asarray(_nonfinite_counts(tree))
    if not counts.any():
        return
    by_path: dict[tuple, str] = {}
    for name, e in entries.items():  # stacked experts: one name for the stack
        paths = [(*e.path, "w_gate"), (*e.path, "w_up")] if e.kind == "fused_gate_up" else [e.path]
        for p in paths:
            by_path.setdefault(p, re.sub(r"experts\.\d+\.", "experts.*.", name))
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    bad, dtype = [], ""
    for (keys, leaf), n in zip(leaves, counts):
        if n:
            where = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keys)
            name = by_path.get(where) or jax.tree_util.keystr(keys)
            file = files.get(name.replace("experts.*.", "experts.0."), "?")
            bad.append(f"{name} ({int(n)} of {leaf.size} values, in {file})")
            dtype = jnp.dtype(leaf.dtype).name
    raise CheckpointError(
        f"{path}: NaN/Inf in {len(bad)} tensor(s) as loaded in {dtype}: "
        + "; ".join(bad[:6])
        + ("; ..." if len(bad) > 6 else "")
        + ". The checkpoint is damaged, or was saved from a diverged run"
    )


def _hf_tensors(cfg: ModelConfig, weights: dict):
    """Yields (HF name, function producing the numpy tensor in HF layout) in file order."""
    for name, e in hf_entries(cfg).items():
        leaf = _get(weights, e.path)
        if isinstance(leaf, QArray):
            raise ValueError(f"save_hf_checkpoint: {name} is a QArray; save the BF16/F32 weights")
        if e.kind == "plain":
            yield name, leaf, lambda x: np.asarray(x)
        elif e.kind == "linear":
            yield name, leaf, lambda x: np.ascontiguousarray(np.asarray(x).T)
        else:
            yield name, leaf, lambda x, i=e.expert: np.ascontiguousarray(np.asarray(x[i]).T)


def _plan_shards(cfg, weights, max_shard_bytes):
    shards: list[list] = [[]]
    size = total = 0
    for name, leaf, fn in _hf_tensors(cfg, weights):
        n = int(np.prod(leaf.shape[-2:] if leaf.ndim == 3 else leaf.shape)) * leaf.dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, leaf, fn))
        size += n
        total += n
    return shards, total


def _write(tmp: str, cfg: ModelConfig, weights: dict, max_shard_bytes: int) -> None:
    dtype = jnp.dtype(weights["embed"].dtype).name
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(torch_dtype=dtype), f, indent=2)
    shards, total = _plan_shards(cfg, weights, max_shard_bytes)
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        host: dict[int, np.ndarray] = {}  # one host copy per leaf (experts share a stack)
        tensors = {}
        for name, leaf, fn in shard:
            if id(leaf) not in host:
                host[id(leaf)] = np.asarray(jax.device_get(leaf))
            tensors[name] = fn(host[id(leaf)])
        del host
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)


def save_hf_checkpoint(
    path,
    cfg: ModelConfig,
    weights: dict,
    *,
    max_shard_bytes: int = 5 * 2**30,
    extra_files_from=None,
    overwrite: bool = False,
    info: dict | None = None,
) -> None:
    """Writes config.json + safetensors in the HF layout (per-expert MoE tensors), atomically.

    Shards above ``max_shard_bytes`` with a ``model.safetensors.index.json``. Files are written to
    a temporary sibling directory, then moved to ``path`` (``hf_dir``): a new or empty directory
    or a previous export is fine; any other non-empty directory raises ``ExportDirError`` unless
    ``overwrite``. Nothing the export did not write is deleted. ``extra_files_from``: a directory
    (or a list of them, later ones win) whose tokenizer/generation files are copied along and whose
    bos/eos ids fill ``config.json`` where ``cfg`` has none; ``info``: JSON-able provenance
    recorded in the export's marker file.
    """
    cfg = with_special_tokens(cfg, extra_files_from)
    with hf_dir.staged(os.path.abspath(os.fspath(path)), overwrite, info) as tmp:
        _write(tmp, cfg, weights, max_shard_bytes)
        copy_tokenizer_files(extra_files_from, tmp)
