"""The block-FP8 export against the rules vLLM, SGLang and transformers apply when they load it.

The rules are written down here from the engines' sources (re-implemented, not imported: neither
engine runs here), and each test builds the modules an engine would build for the exported
config, decides for each whether it is FP8 the way that engine decides, and checks that the
tensors on disk are what that decision needs:

vLLM (github.com/vllm-project/vllm):
  V1 ``model_executor/layers/quantization/fp8.py`` ``Fp8Config.get_quant_method``: a
     ``LinearBase`` is unquantized iff ``is_layer_skipped(prefix, ignored_layers,
     fused_mapping=packed_modules_mapping)``; a ``FusedMoE`` iff ``is_layer_skipped(...,
     skip_with_substr=True)`` (some listed name contains its prefix, ``_vllm_skipped`` below).
  V2 ``quantization/utils/quant_utils.py`` ``is_layer_skipped``: a fused prefix (``qkv_proj``,
     ``gate_up_proj``) is mapped to its shard prefixes, which must all agree (ValueError "some but
     not all shards ... are quantized"); other prefixes: exact membership.
  V3 ``models/qwen3_moe.py`` ``Qwen3MoeSparseMoeBlock``: ``self.gate = ReplicatedLinear(...,
     quant_config=quant_config, prefix=f"{prefix}.gate")``: the router is a quantized linear
     unless ``mlp.gate`` is listed.
  V4 ``quantization/utils/fp8_utils.py`` ``validate_fp8_block_shape``: for a merged linear
     every output partition but the last must be divisible by ``block_n`` (all of them under
     tensor parallelism); ``create_fp8_scale_parameter``: ``weight_scale_inv`` is
     ``[ceil(N/bn), ceil(K/bk)]``.
SGLang (github.com/sgl-project/sglang):
  S1 ``srt/layers/quantization/fp8.py`` ``Fp8Config.get_quant_method``: a ``LinearBase`` is
     unquantized iff ``is_layer_skipped(prefix, self.ignored_layers)``, with no fused mapping
     (``srt/layers/quantization/utils.py``): the fused name ``qkv_proj`` must itself be listed;
     every ``FusedMoE`` gets ``Fp8MoEMethod``.
  S2 ``validate_fp8_block_shape`` (its copy in ``srt/layers/quantization/fp8_utils.py``): every
     merged partition divisible by ``block_n``.
  S3 ``srt/models/qwen3_moe.py``: the router ``gate`` is a ``ReplicatedLinear`` with
     ``quant_config=None`` (always BF16).
transformers (``integrations/finegrained_fp8.py`` ``Fp8Dequantize``):
  T1 the block is inferred as ``rows // scale_rows``, ``cols // scale_cols``: every FP8 weight
     must be whole blocks (``N % bn == K % bk == 0``) or it is dequantized wrong, silently.
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.generation import RolloutConfig, rollout_weights
from fp8rl_jax.models import ModelConfig, init_weights, save_fp8_checkpoint
from fp8rl_jax.models.hf import UnservableExportError
from fp8rl_jax.models.hf.layout import _read_safetensors
from fp8rl_jax.quant import QuantRecipe

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
FP8 = ml_dtypes.float8_e4m3fn


def _vllm_skipped(prefix, ignored, fused=True, substr=False):
    """V2 (``is_layer_skipped``), with V1's two uses."""
    match = (lambda p: any(i in p for i in ignored)) if substr else (lambda p: p in ignored)
    proj = prefix.split(".")[-1]
    if fused and proj in FUSED:
        shards = {match(prefix.replace(proj, s)) for s in FUSED[proj]}
        if len(shards) > 1:
            raise ValueError(f"some but not all shards of {prefix} are quantized")
        return shards.pop()
    if "experts" in prefix and not substr:
        return any(prefix in i for i in ignored if "experts" in i)
    return match(prefix)


def _sglang_skipped(prefix, ignored):
    """S1: exact membership, no fused mapping."""
    return prefix in ignored


def _modules(cfg):
    """What both engines build for Qwen3 / Qwen3-MoE: (prefix, kind, [shard HF modules])."""
    out = []
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out.append((f"{a}.qkv_proj", "linear", [f"{a}.{p}" for p in FUSED["qkv_proj"]]))
        out.append((f"{a}.o_proj", "linear", [f"{a}.o_proj"]))
        if cfg.is_moe_layer(i):
            out.append((f"{m}.gate", "router", [f"{m}.gate"]))
            experts = [
                f"{m}.experts.{e}.{p}_proj"
                for e in range(cfg.num_experts)
                for p in ("gate", "up", "down")
            ]
            out.append((f"{m}.experts", "moe", experts))
        else:
            out.append((f"{m}.gate_up_proj", "linear", [f"{m}.{p}" for p in FUSED["gate_up_proj"]]))
            out.append((f"{m}.down_proj", "linear", [f"{m}.down_proj"]))
    return out


def _check_tensors(engine, prefix, shards, fp8, tensors, block):
    for s in shards:
        w, scale = tensors[s + ".weight"], tensors.get(s + ".weight_scale_inv")
        if not fp8:
            assert w.dtype != FP8 and scale is None, f"{engine}: {s} is BF16 there, not on disk"
            continue
        assert w.dtype == FP8 and scale is not None, f"{engine}: {s} is FP8 there, BF16 on disk"
        N, K = w.shape
        assert scale.shape == (-(-N // block[0]), -(-K // block[1])), (engine, s)  # V4
        assert N % block[0] == 0 and K % block[1] == 0, f"transformers (T1): {s} {w.shape}"
    if fp8 and len(shards) > 1 and "experts" not in prefix:  # V4 / S2: merged partitions
        sizes = [tensors[s + ".weight"].shape[0] for s in shards]
        assert all(n % block[0] == 0 for n in sizes), f"{engine}: {prefix} partitions {sizes}"


def check_serving_rules(out_dir, cfg):
    """Asserts that vLLM, SGLang and transformers would load ``out_dir`` as written."""
    config = json.loads((out_dir / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["activation_scheme"] == "dynamic"
    block, ignored = quant["weight_block_size"], quant.get("ignored_layers", [])
    tensors = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        tensors.update(_read_safetensors(str(f)))
    for prefix, kind, shards in _modules(cfg):
        if kind == "moe":
            vllm = not _vllm_skipped(prefix, ignored, substr=True)
            sglang = True  # S1: FusedMoE is always FP8
        elif kind == "router":
            vllm = not _vllm_skipped(prefix, ignored)  # V3
            sglang = False  # S3
        else:
            vllm = not _vllm_skipped(prefix, ignored)
            sglang = not _sglang_skipped(prefix, ignored)
        _check_tensors("vLLM", prefix, shards, vllm, tensors, block)
        _check_tensors("SGLang", prefix, shards, sglang, tensors, block)


def _export(tmp_path, cfg, recipe=None, unservable="error", name="fp8"):
    params = init_weights(cfg, jax.random.key(0), jnp.float32)
    weights, _ = rollout_weights(params, RolloutConfig(quant=recipe or QuantRecipe()))
    out = tmp_path / name
    save_fp8_checkpoint(out, cfg, weights, unservable=unservable)
    return out


DENSE = ModelConfig(
    vocab_size=64, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
    intermediate_size=256, qk_norm=True, architecture="Qwen3ForCausalLM",
)  # fmt: skip
MOE = ModelConfig(
    vocab_size=64, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
    intermediate_size=256, qk_norm=True, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=128, mlp_only_layers=(1,), architecture="Qwen3MoeForCausalLM",
)  # fmt: skip


def test_dense_export_follows_the_rules(tmp_path):
    out = _export(tmp_path, DENSE)
    check_serving_rules(out, DENSE)
    assert (
        "ignored_layers" not in json.loads((out / "config.json").read_text())["quantization_config"]
    )


def test_moe_router_is_listed(tmp_path):
    out = _export(tmp_path, MOE)
    check_serving_rules(out, MOE)
    ignored = json.loads((out / "config.json").read_text())["quantization_config"]
    assert ignored["ignored_layers"] == ["model.layers.0.mlp.gate"]  # layer 1 is dense


def test_kept_layer_is_listed_per_projection_and_fused(tmp_path):
    out = _export(tmp_path, DENSE, QuantRecipe(keep_first_n=1))
    check_serving_rules(out, DENSE)
    ignored = json.loads((out / "config.json").read_text())["quantization_config"]
    a, m = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert ignored["ignored_layers"] == sorted(
        [f"{a}.{p}_proj" for p in ("q", "k", "v", "qkv", "o")]
        + [f"{m}.{p}_proj" for p in ("gate", "up", "gate_up", "down")]
    )


def test_rule_checker_catches_what_the_old_export_wrote(tmp_path):
    """The checker fails on the exports issue 23 found: an unlisted router, per-projection-only
    names. (A test of the test: otherwise it could pass on anything.)"""
    out = _export(tmp_path, MOE)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].pop("ignored_layers")
    path.write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="vLLM: model.layers.0.mlp.gate is FP8 there"):
        check_serving_rules(out, MOE)
    out = _export(tmp_path, DENSE, QuantRecipe(keep_first_n=1), name="kept")
    path = out / "config.json"
    config = json.loads(path.read_text())
    ignored = config["quantization_config"]["ignored_layers"]
    config["quantization_config"]["ignored_layers"] = [n for n in ignored if "qkv" not in n]
    path.write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="SGLang: model.layers.0.self_attn.q_proj is FP8"):
        check_serving_rules(out, DENSE)


UNEVEN = ModelConfig(
    vocab_size=64, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=128,
    intermediate_size=192, qk_norm=True, architecture="Qwen3ForCausalLM",
)  # fmt: skip


def test_partial_blocks_are_refused_naming_the_tensor(tmp_path):
    with pytest.raises(UnservableExportError, match=r"model\.layers\.0\.mlp\.gate_proj: N=192"):
        _export(tmp_path, UNEVEN)
    assert not (tmp_path / "fp8").exists()  # nothing written


def test_partial_blocks_kept_in_bf16_with_the_flag(tmp_path):
    out = _export(tmp_path, UNEVEN, unservable="bf16")
    check_serving_rules(out, UNEVEN)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    m = "model.layers.0.mlp"
    assert quant["ignored_layers"] == [f"{m}.{p}_proj" for p in ("down", "gate", "gate_up", "up")]
    tensors = _read_safetensors(str(out / "model.safetensors"))
    assert tensors[f"{m}.gate_proj.weight"].dtype == ml_dtypes.bfloat16
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == FP8


def test_mixed_precision_fused_group_is_refused(tmp_path):
    recipe = QuantRecipe(exclude=(*QuantRecipe().exclude, r"wq"))  # q_proj kept, k/v FP8
    with pytest.raises(UnservableExportError, match="qkv_proj is fused with BF16"):
        _export(tmp_path, DENSE, recipe)
    out = _export(tmp_path, DENSE, recipe, unservable="bf16")
    check_serving_rules(out, DENSE)
    ignored = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.self_attn.qkv_proj" in ignored["ignored_layers"]
    assert np.all(
        [
            _read_safetensors(str(out / "model.safetensors"))[
                f"model.layers.1.self_attn.{p}_proj.weight"
            ].dtype
            == ml_dtypes.bfloat16
            for p in "qkv"
        ]
    )
