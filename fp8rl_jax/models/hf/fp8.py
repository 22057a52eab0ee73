"""The FP8 rollout policy as a block-FP8 HF checkpoint (the DeepSeek-V3 layout vLLM/SGLang load).

Format (DeepSeek-V3's release, read by vLLM's ``Fp8Config`` and SGLang): every quantized linear
layer ``<m>.weight`` is stored as ``float8_e4m3fn [N, K]`` (out x in, the HF layout and our
K-major ``QArray`` layout, so no transpose) plus ``<m>.weight_scale_inv`` float32
``[ceil(N/bn), ceil(K/bk)]``. Despite its name, ``weight_scale_inv`` is the *dequantization
multiplier*: ``W[n, k] ≈ weight[n, k] · weight_scale_inv[n // bn, k // bk]`` (DeepSeek-V3's
``weight_dequant``; vLLM passes it as the B-operand scale of its block-FP8 GEMM). That is our
``QArray.scales`` (``x ≈ values · scales``, DESIGN.md §4.2), stored as is. ``config.json`` gains
``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bn, bk]}``: activations are quantized per token in 1 x bk groups at run time,
as our rollout does (§4.3). What the rollout keeps high precision (embeddings, lm_head, norms,
MoE router, biases; §4.4) is written in BF16; linear layers the recipe keeps (``keep_first_n``,
exclusion patterns) are listed in ``ignored_layers``, so vLLM runs them unquantized.

``load_fp8_checkpoint`` reads such a directory back into the rollout's weights pytree (QArray
leaves where the file has FP8 weights), or dequantized to plain ``[K, N]`` training weights.
safetensors' numpy reader has no FP8 dtype, so tensors are read from the file's header and
byte ranges directly (``ml_dtypes`` dtypes).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.hf import dir as hf_dir
from fp8rl_jax.models.hf import serving
from fp8rl_jax.models.hf.layout import (
    _IGNORED,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    _get,
    _read_safetensors,
    _shard_files,
    copy_tokenizer_files,
    hf_entries,
    with_special_tokens,
)
from kernels_pallas.qarray import QArray, dequantize_weight

SCALE_SUFFIX = "_scale_inv"  # <m>.weight -> <m>.weight_scale_inv
QUANT_METHOD = "fp8"


def quantization_config(block_shape: tuple[int, int], ignored_layers=()) -> dict:
    """The ``config.json`` entry of a block-FP8 (E4M3, dynamic activations) checkpoint."""
    out = {
        "quant_method": QUANT_METHOD,
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [int(b) for b in block_shape],
    }
    if ignored_layers:
        out["ignored_layers"] = sorted(ignored_layers)
    return out


def _fp8_tensors(cfg: ModelConfig, weights: dict):
    """Yields ``(name, leaf, to_host)``; to_host maps the leaf's host copy to the HF tensor."""
    for name, e in hf_entries(cfg).items():
        leaf = _get(weights, e.path)
        pick = (lambda x: x) if e.kind != "expert" else (lambda x, i=e.expert: x[i])
        if isinstance(leaf, QArray):  # [.., N, K] already: the HF layout
            yield name, leaf.values, lambda x, p=pick: np.ascontiguousarray(p(x))
            yield name + SCALE_SUFFIX, leaf.scales, lambda x, p=pick: np.ascontiguousarray(p(x))
        elif e.kind == "plain":
            yield name, leaf, lambda x: np.asarray(x, ml_dtypes.bfloat16)
        else:  # a kept linear layer: training layout [.., K, N] -> [N, K]
            yield name, leaf, lambda x, p=pick: np.ascontiguousarray(p(x).T, ml_dtypes.bfloat16)


def _block_shape(cfg: ModelConfig, weights: dict) -> tuple[int, int]:
    blocks = set()
    for name, e in hf_entries(cfg).items():
        leaf = _get(weights, e.path)
        if isinstance(leaf, QArray):
            if jnp.dtype(leaf.values.dtype) != jnp.float8_e4m3fn or len(leaf.block_shape) != 2:
                raise ValueError(
                    f"save_fp8_checkpoint: {name} is {leaf.values.dtype} with blocks "
                    f"{leaf.block_shape}; the block-FP8 format needs E4M3 and 2-D blocks"
                )
            blocks.add(tuple(leaf.block_shape))
    if len(blocks) != 1:
        raise ValueError(f"save_fp8_checkpoint: need one weight block shape, got {blocks}")
    return blocks.pop()


def _serving_plan(cfg: ModelConfig, weights: dict, unservable: serving.Unservable):
    """``(weights with demoted layers in BF16 [.., K, N], block, ignored_layers)``."""
    block = _block_shape(cfg, weights)
    linears, routers, paths = [], [], {}
    for name, e in hf_entries(cfg).items():
        module = name.rsplit(".", 1)[0]
        if e.path[-1] == "router":
            routers.append(module)
        elif e.kind in ("linear", "expert") and module != "lm_head":
            leaf = _get(weights, e.path)
            linears.append(serving.Linear(module, e.hf_shape, isinstance(leaf, QArray)))
            paths[module] = e.path
    demoted, ignored = serving.plan(linears, block, routers, unservable)
    if demoted:  # the FP8 policy dequantized: values · scales, in BF16
        weights = jax.tree.map(lambda x: x, weights, is_leaf=lambda x: isinstance(x, QArray))
        for path in {paths[m] for m in demoted}:
            leaf = _get(weights, path)
            if isinstance(leaf, QArray):
                _get(weights, path[:-1])[path[-1]] = dequantize_weight(leaf, jnp.bfloat16)
    return weights, block, ignored


def _fp8_config(cfg: ModelConfig, block, ignored) -> dict:
    hf = cfg.to_hf_config(torch_dtype="bfloat16")
    hf["quantization_config"] = quantization_config(block, ignored)
    return hf


def save_fp8_checkpoint(
    path,
    cfg: ModelConfig,
    weights: dict,
    *,
    max_shard_bytes: int = 5 * 2**30,
    extra_files_from=None,
    overwrite: bool = False,
    info: dict | None = None,
    unservable: serving.Unservable = "error",
) -> None:
    """Writes the rollout weights (QArray leaves, ``generation.rollout_weights``) in block FP8.

    ``weights``: the rollout's pytree: QArray ``[.., N, K]`` leaves (E4M3, one block shape) for
    the quantized layers, high-precision arrays elsewhere (written in BF16 and listed in
    ``ignored_layers`` with the MoE routers, per projection and fused: ``hf.serving``). A weight
    that vLLM, SGLang or transformers would load wrong (a partial block, a fused group of mixed
    precision, BF16 experts) raises ``UnservableExportError`` naming it, unless
    ``unservable="bf16"``: then it is written in BF16 (values · scales) and listed.
    Shards above ``max_shard_bytes`` with a ``model.safetensors.index.json``. The target rules
    are the BF16 export's (``hf.dir``): a new or empty directory or a previous export; any other
    non-empty directory raises ``ExportDirError`` unless ``overwrite``; nothing the export did not
    write is deleted; files get the umask's mode. ``extra_files_from``: a checkpoint or tokenizer
    directory (or a list of them, later ones win) whose tokenizer and generation files are copied
    along and whose bos/eos ids fill ``config.json`` where ``cfg`` has none; ``info``: provenance
    for the marker file.
    """
    weights, block, ignored = _serving_plan(cfg, weights, unservable)
    info = {"weights": "block fp8", **(info or {})}
    with hf_dir.staged(os.path.abspath(os.fspath(path)), overwrite, info) as tmp:
        copy_tokenizer_files(extra_files_from, tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(
                _fp8_config(with_special_tokens(cfg, extra_files_from), block, ignored), f, indent=2
            )
        _write_shards(tmp, cfg, weights, max_shard_bytes)


def _write_shards(tmp: str, cfg: ModelConfig, weights: dict, max_shard_bytes: int) -> None:
    shards, size = [[]], 0
    for name, leaf, fn in _fp8_tensors(cfg, weights):
        n = leaf.nbytes // (leaf.shape[0] if leaf.ndim == 3 else 1)
        if shards[-1] and size + n > max_shard_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append((name, leaf, fn))
        size += n
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}"
        fname += "" if len(shards) == 1 else ".safetensors"
        host: dict[int, np.ndarray] = {}  # one host copy per leaf (experts share a stack)
        tensors = {}
        for name, leaf, fn in shard:
            if id(leaf) not in host:
                host[id(leaf)] = np.asarray(jax.device_get(leaf))
            tensors[name] = fn(host[id(leaf)])
            total += tensors[name].nbytes
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if len(shards) > 1:
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def is_fp8_checkpoint(path) -> bool:
    """Whether ``path/config.json`` declares a block-FP8 ``quantization_config``."""
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        quant = json.load(f).get("quantization_config") or {}
    return quant.get("quant_method") == QUANT_METHOD


def _read_quant_config(path: str) -> tuple[tuple[int, int], set[str]]:
    """``(weight_block_size, ignored_layers)`` (transformers writes ``modules_to_not_convert``)."""
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size") or ())
    ok = quant.get("quant_method") == QUANT_METHOD and quant.get("fmt", "e4m3") == "e4m3"
    if not ok or len(block) != 2 or quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"{path}: quantization_config {quant!r} is not block FP8 (quant_method fp8, fmt "
            "e4m3, activation_scheme dynamic, weight_block_size [bn, bk])"
        )
    ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or ()
    return (int(block[0]), int(block[1])), set(ignored)


def _listed(name: str, ignored: set[str]) -> bool:
    """Whether the module of HF tensor ``name`` is in ``ignored_layers`` (its own or fused name)."""
    module = name.rsplit(".", 1)[0]
    return module in ignored or serving.fused_name(module) in ignored


def _check(name: str, arr, scale, e, block) -> None:
    if tuple(arr.shape) != e.hf_shape:
        raise CheckpointError(f"shape mismatch for {name}: got {arr.shape}, expected {e.hf_shape}")
    if scale is None:
        if arr.dtype == ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"{name} is FP8 but {name}{SCALE_SUFFIX} is missing")
        return
    want = tuple(-(-d // b) for d, b in zip(e.hf_shape, block, strict=True))
    if arr.dtype != ml_dtypes.float8_e4m3fn or tuple(scale.shape) != want:
        raise CheckpointError(
            f"{name}: FP8 weight must be float8_e4m3fn with {name}{SCALE_SUFFIX} of shape {want}, "
            f"got {arr.dtype} and {tuple(scale.shape)}"
        )


def _leaf(arr, scale, block, dtype, dequantize: bool):
    """One HF tensor [(E,) N, K] (with its scales) as our leaf: QArray [N, K] or weight [K, N]."""
    if scale is None:
        return jnp.asarray(np.swapaxes(arr.astype(np.float32), -1, -2), dtype)
    q = QArray(jnp.asarray(arr), jnp.asarray(scale, jnp.float32), block, jnp.dtype(dtype))
    return dequantize_weight(q, dtype) if dequantize else q


def load_fp8_checkpoint(path, *, dtype=jnp.bfloat16, dequantize: bool = False):
    """``(config, weights)`` of a block-FP8 checkpoint (``save_fp8_checkpoint``, DeepSeek-V3).

    Quantized layers become QArray ``[.., N, K]`` leaves (the rollout's weights: a forward over
    them runs W8A8), or with ``dequantize`` plain ``[.., K, N]`` weights ``weight ·
    weight_scale_inv`` in ``dtype`` (to train from an FP8 checkpoint; DeepSeek-V3's
    ``weight_dequant``, partial edge blocks included). Other tensors: ``dtype``. Any DeepSeek-V3 /
    Qwen-FP8-layout checkpoint reads, whoever wrote it; its ``ignored_layers`` (or
    ``modules_to_not_convert``) must name BF16 tensors only. Missing or extra tensors, wrong
    shapes and an FP8 tensor of a listed module raise ``CheckpointError``.
    """
    path = os.fspath(path)
    block, ignored = _read_quant_config(path)
    cfg = ModelConfig.from_hf_config(path)
    tensors: dict[str, np.ndarray] = {}
    for shard in _shard_files(path):
        tensors.update(_read_safetensors(os.path.join(path, shard)))
    entries = hf_entries(cfg)
    expected = set(entries) | {n + SCALE_SUFFIX for n in entries if n + SCALE_SUFFIX in tensors}
    present = {n for n in tensors if not _IGNORED.search(n)} - (
        {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    )
    if present != expected:
        raise CheckpointError(
            f"{path}: missing tensor(s) {sorted(expected - present)[:8]}, "
            f"unexpected tensor(s) {sorted(present - expected)[:8]}"
        )
    tree: dict = {"layers": [{"attn": {}, "mlp": {}} for _ in range(cfg.num_layers)]}
    experts: dict[tuple, list] = {}
    for name, e in entries.items():
        arr, scale = tensors[name], tensors.get(name + SCALE_SUFFIX)
        _check(name, arr, scale, e, block)
        if scale is not None and _listed(name, ignored):
            raise CheckpointError(
                f"{path}: {name} is FP8 but its module is in quantization_config.ignored_layers "
                "(readers would load it as BF16): the checkpoint contradicts its config"
            )
        if e.kind == "expert":
            experts.setdefault(e.path, [None] * cfg.num_experts)[e.expert] = (arr, scale)
            continue
        if e.kind == "plain":
            leaf = jnp.asarray(arr.astype(np.float32), dtype)
        else:
            leaf = _leaf(arr, scale, block, dtype, dequantize)
        _get(tree, e.path[:-1])[e.path[-1]] = leaf
    for p, items in experts.items():
        arr = np.stack([a for a, _ in items])
        scale = None if items[0][1] is None else np.stack([s for _, s in items])
        _get(tree, p[:-1])[p[-1]] = _leaf(arr, scale, block, dtype, dequantize)
    return cfg, tree
