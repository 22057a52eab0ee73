"""HF checkpoints (config.json + safetensors, sharded or not) <-> the weights pytree, without torch.

Loading reads one shard at a time through ``safe_open`` (memory-mapped), converts each tensor to
the target dtype and moves it to the device before the next, so the host never holds two full
copies. Stacked experts are assembled one layer at a time. MoE experts may be stored per expert
(``mlp.experts.{e}.gate_proj.weight``, the Qwen3-MoE release layout, which is what we save) or
fused (``mlp.experts.gate_up_proj`` [E, 2F, D] and ``mlp.experts.down_proj`` [E, D, F], the
transformers v5 in-memory layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from fp8rl_jax.models import hf_dir
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.hf_dir import ExportDirError  # noqa: F401 (re-exported)
from kernels_pallas.qarray import QArray

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


class CheckpointError(ValueError):
    """A checkpoint does not match its config (missing/extra tensor, wrong shape)."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: tuple  # where the tensor goes in the weights pytree
    hf_shape: tuple[int, ...]
    kind: str  # "plain" | "linear" (transpose) | "expert" | "fused_gate_up" | "fused_down"
    expert: int = -1


def _layer_entries(cfg: ModelConfig, i: int, fused: bool) -> dict[str, _Entry]:
    D, H, K, C = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pre, L = f"model.layers.{i}.", ("layers", i)
    out = {
        pre + "input_layernorm.weight": _Entry((*L, "attn_norm"), (D,), "plain"),
        pre + "post_attention_layernorm.weight": _Entry((*L, "mlp_norm"), (D,), "plain"),
    }
    a = (*L, "attn")
    for name, ours, n_out in (("q", "wq", H * C), ("k", "wk", K * C), ("v", "wv", K * C)):
        out[f"{pre}self_attn.{name}_proj.weight"] = _Entry((*a, ours), (n_out, D), "linear")
        if cfg.qkv_bias:
            out[f"{pre}self_attn.{name}_proj.bias"] = _Entry(
                (*a, f"{name}_bias"), (n_out,), "plain"
            )
    out[pre + "self_attn.o_proj.weight"] = _Entry((*a, "wo"), (D, H * C), "linear")
    if cfg.o_bias:
        out[pre + "self_attn.o_proj.bias"] = _Entry((*a, "o_bias"), (D,), "plain")
    if cfg.qk_norm:
        out[pre + "self_attn.q_norm.weight"] = _Entry((*a, "q_norm"), (C,), "plain")
        out[pre + "self_attn.k_norm.weight"] = _Entry((*a, "k_norm"), (C,), "plain")
    m = (*L, "mlp")
    if not cfg.is_moe_layer(i):
        F = cfg.intermediate_size
        for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            out[f"{pre}mlp.{name}_proj.weight"] = _Entry((*m, f"w_{name}"), shape, "linear")
        return out
    E, F = cfg.num_experts, cfg.moe_intermediate_size
    out[pre + "mlp.gate.weight"] = _Entry((*m, "router"), (E, D), "linear")
    if fused:
        out[pre + "mlp.experts.gate_up_proj"] = _Entry(m, (E, 2 * F, D), "fused_gate_up")
        out[pre + "mlp.experts.down_proj"] = _Entry((*m, "w_down"), (E, D, F), "fused_down")
        return out
    for e in range(E):
        for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            out[f"{pre}mlp.experts.{e}.{name}_proj.weight"] = _Entry(
                (*m, f"w_{name}"), shape, "expert", e
            )
    return out


def hf_entries(cfg: ModelConfig, *, fused_experts: bool = False) -> dict[str, _Entry]:
    """HF tensor name -> where it goes in our pytree and its on-disk shape."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": _Entry(("embed",), (V, D), "plain")}
    for i in range(cfg.num_layers):
        out.update(_layer_entries(cfg, i, fused_experts))
    out["model.norm.weight"] = _Entry(("final_norm",), (D,), "plain")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _Entry(("lm_head",), (V, D), "linear")
    return out


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def _tensor_files(path: str, shards: list[str]) -> dict[str, str]:
    names: dict[str, str] = {}
    for shard in shards:
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"shard {shard} listed in {INDEX_FILE} not found in {path}")
        with _open_shard(file) as f:
            names.update(dict.fromkeys(f.keys(), shard))  # noqa: SIM118 (safe_open is no dict)
    return names


@contextlib.contextmanager
def _open_shard(file: str):
    """``safe_open`` whose errors name the file (a truncated download, a full disk)."""
    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(
            f"{file}: not a readable safetensors file (truncated or corrupt?): {e}"
        ) from None


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
    from fp8rl_jax.models import hf_fp8

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


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


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
    whose tokenizer/generation files are copied along; ``info``: JSON-able provenance recorded
    in the export's marker file.
    """
    with hf_dir.staged(os.path.abspath(os.fspath(path)), overwrite, info) as tmp:
        _write(tmp, cfg, weights, max_shard_bytes)
        for fname in _TOKENIZER_FILES if extra_files_from else ():
            src = os.path.join(os.fspath(extra_files_from), fname)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(tmp, fname))
