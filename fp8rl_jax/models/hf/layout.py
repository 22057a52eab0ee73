"""The HF checkpoint layout: tensor names for a ModelConfig, shard files, raw safetensors reads.

The one table both the BF16 (``io``) and the block-FP8 (``fp8``) readers and writers use:
``hf_entries`` maps each HF tensor name to where it goes in our weights pytree, its on-disk shape
and how it is laid out (a plain vector, a linear ``[out, in]`` that we store ``[in, out]``, one
expert of a stack, or transformers v5's fused expert tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from fp8rl_jax.models.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
TOKENIZER_FILES = (
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


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


_DTYPES = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I32": np.int32,
    "I64": np.int64,
}


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file (memory-mapped), FP8 and BF16 included."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    data = np.memmap(file, np.uint8, "r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{file}: {name} has unsupported dtype {info['dtype']}")
        start, stop = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        out[name] = data[start:stop].view(dtype).reshape(info["shape"])
    return out


def _dirs(src) -> list[str]:
    if src is None:
        return []
    return [os.fspath(src)] if isinstance(src, str | os.PathLike) else [os.fspath(s) for s in src]


def copy_tokenizer_files(src, dst: str) -> list[str]:
    """Copies the tokenizer and generation files of directory ``src`` (or of each directory of a
    list, later ones replacing earlier ones) into ``dst``."""
    copied = []
    for d in _dirs(src):
        for fname in TOKENIZER_FILES:
            path = os.path.join(d, fname)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(dst, fname))
                copied.append(fname)
    return copied


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def with_special_tokens(cfg: ModelConfig, src) -> ModelConfig:
    """``cfg`` with the bos/eos ids of the directories ``src`` where ``cfg`` has none."""
    ids: dict = {}
    for d in _dirs(src):
        ids.update(special_token_ids(d))
    bos, eos = ids.get("bos_token_id"), ids.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return dataclasses.replace(
        cfg,
        bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else bos,
        eos_token_id=cfg.eos_token_id or eos,
    )


def special_token_ids(src) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` of a checkpoint or tokenizer directory, where known.

    From ``generation_config.json``, else the ``bos_token`` / ``eos_token`` strings of
    ``tokenizer_config.json`` looked up in ``tokenizer.json`` (added tokens, then the vocab).
    """
    src = os.fspath(src)
    gen = _read_json(os.path.join(src, "generation_config.json"))
    tok_cfg = _read_json(os.path.join(src, "tokenizer_config.json"))
    tok = _read_json(os.path.join(src, "tokenizer.json"))
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if "content" in t}
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids = {**vocab, **ids}
    out = {}
    for key in ("bos", "eos"):
        value = gen.get(f"{key}_token_id")
        token = tok_cfg.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if value is None and isinstance(token, str):
            value = ids.get(token)
        if value is not None:
            out[f"{key}_token_id"] = value
    return out
