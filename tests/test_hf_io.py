"""HF checkpoint I/O: errors name the tensor and file; fused experts; atomic sharded save."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from fp8rl_jax.models import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from fp8rl_jax.quant import QuantRecipe, quantize_params

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(ROOT, "qwen3")), reason="no fixtures"
)


def copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(ROOT, name), dst)
    return dst


def read(file):
    with safe_open(str(file), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory not found"):
        load_hf_checkpoint(tmp_path / "nope")
    d = copy("qwen3", tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(d)


def test_missing_weights_file(tmp_path):
    d = copy("qwen3", tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(d)


def test_missing_shard_listed_in_index(tmp_path):
    d = copy("qwen3_moe", tmp_path)
    os.remove(d / "model-00002-of-00004.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00004"):
        load_hf_checkpoint(d)


def test_missing_tensor(tmp_path):
    d = copy("qwen3", tmp_path)
    t = read(d / "model.safetensors")
    del t["model.layers.1.self_attn.k_norm.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.self_attn\.k_norm"):
        load_hf_checkpoint(d)


def test_unexpected_extra_tensor(tmp_path):
    d = copy("qwen3", tmp_path)
    t = read(d / "model.safetensors")
    t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"extra_proj.*model\.safetensors"):
        load_hf_checkpoint(d)


def test_shape_mismatch(tmp_path):
    d = copy("qwen3", tmp_path)
    t = read(d / "model.safetensors")
    t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((64, 32), np.float32)
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"q_proj\.weight in model\.safetensors.*\(64, 32\)"):
        load_hf_checkpoint(d)


def test_unsupported_architecture(tmp_path):
    d = copy("qwen3", tmp_path)
    c = json.loads((d / "config.json").read_text())
    c["architectures"] = ["MistralForCausalLM"]
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="architectures"):
        load_hf_checkpoint(d)


def _fuse_experts(d):
    """Rewrites a per-expert Qwen3-MoE checkpoint with v5 fused gate_up_proj/down_proj tensors."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(read(d / f))
        os.remove(d / f)
    for i in range(3):
        pre = f"model.layers.{i}.mlp.experts."
        if f"{pre}0.gate_proj.weight" not in tensors:
            continue
        gate, up, down = (
            np.stack([tensors.pop(f"{pre}{e}.{n}_proj.weight") for e in range(4)])
            for n in ("gate", "up", "down")
        )
        tensors[pre + "gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2F, D]
        tensors[pre + "down_proj"] = down  # [E, D, F]
    os.remove(d / "model.safetensors.index.json")
    save_file(tensors, d / "model.safetensors")


def test_fused_expert_checkpoint_loads_identically(tmp_path):
    _, ref = load_hf_checkpoint(os.path.join(ROOT, "qwen3_moe"), dtype=jnp.float32)
    d = copy("qwen3_moe", tmp_path)
    _fuse_experts(d)
    _, w = load_hf_checkpoint(d, dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(w), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_is_sharded_with_index_and_atomic(tmp_path):
    cfg, w = load_hf_checkpoint(os.path.join(ROOT, "qwen3_moe"), dtype=jnp.bfloat16)
    out = tmp_path / "ckpt"
    save_hf_checkpoint(out, cfg, w, max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.isfile(out / s) for s in shards)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # A failing save (QArray weights) leaves the previous checkpoint intact and no temp dir.
    before = sorted(os.listdir(out))
    with pytest.raises(ValueError, match="QArray"):
        save_hf_checkpoint(out, cfg, quantize_params(w, QuantRecipe()))
    assert sorted(os.listdir(out)) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # A previous export is replaced as a whole (single file below the shard size).
    save_hf_checkpoint(out, cfg, w, extra_files_from=os.path.join(ROOT, "tokenizer"))
    assert sorted(os.listdir(out)) == [
        "config.json", "fp8rl_export.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
