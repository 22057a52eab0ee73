"""Sharding rules on device-free meshes (AbstractMesh): specs, fallbacks, QArray scales, memory.

The 8-device runs of the sharded programs are in test_sharding_mesh.py (subprocesses).
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fields import batched
from fp8rl_jax.generation.kv import init_cache
from fp8rl_jax.models import ModelConfig
from fp8rl_jax.quant import QuantRecipe, quantize_params
from fp8rl_jax.rl import init_train_state
from fp8rl_jax.train import sharding as sh
from fp8rl_jax.train.memory import memory_estimate

D, H, K, C, F = 64, 4, 2, 16, 128


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=D, num_layers=2, num_heads=H, num_kv_heads=K,
                head_dim=C, intermediate_size=F, qk_norm=True,
                architecture="Qwen3ForCausalLM")  # fmt: skip
    return ModelConfig(**{**base, **kw})


def _abstract_weights(cfg):
    from fp8rl_jax.models import init_weights

    return jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0), jnp.float32))


def _specs(cfg, mesh_cfg, rules, n=8, weights=None):
    mesh = sh.abstract_mesh(mesh_cfg, n)
    w = _abstract_weights(cfg) if weights is None else weights
    return jax.tree.map(lambda s: s.spec, sh.param_shardings(w, cfg, mesh, rules))


def test_mesh_config_resolves_the_rest_and_validates():
    assert sh.MeshConfig(data=2, tensor=2).axis_sizes(8) == (2, 2, 1, 2)  # fsdp=-1 -> 2
    assert sh.MeshConfig(data=1, fsdp=1, expert=4, tensor=2).axis_sizes(8) == (1, 1, 4, 2)
    with pytest.raises(ValueError, match="needs 16 devices but 8 are available"):
        sh.MeshConfig(data=2, fsdp=2, tensor=4).axis_sizes(8)
    with pytest.raises(ValueError, match="not divisible by the fixed axes"):
        sh.MeshConfig(tensor=3).axis_sizes(8)
    with pytest.raises(ValueError, match="at most one -1"):
        sh.MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        sh.MeshConfig(tensor=0)


def test_make_mesh_uses_auto_axes_on_one_device():
    mesh = sh.make_mesh(sh.MeshConfig())
    assert mesh.axis_names == sh.MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


def test_train_rules_fsdp_plus_tensor_parallel():
    s = _specs(_cfg(), sh.MeshConfig(data=2, fsdp=2, tensor=2), sh.TRAIN_RULES)
    attn, mlp = s["layers"][0]["attn"], s["layers"][0]["mlp"]
    assert attn["wq"] == P("fsdp", "tensor")  # [D, H*C]: heads over tensor, D over fsdp
    assert attn["wo"] == P("tensor", "fsdp")
    assert mlp["w_down"] == P("tensor", "fsdp")
    assert s["embed"] == P("tensor", "fsdp")  # [V, D]: vocab over tensor
    s8 = _specs(_cfg(vocab_size=256, tie_word_embeddings=False), sh.MeshConfig(fsdp=8),
                sh.TRAIN_RULES)  # fmt: skip
    assert s8["embed"] == P(None, "fsdp")  # FSDP avoids vocab (embedding-grad scatter-add)
    assert s8["lm_head"] == P("fsdp", None)
    assert s["layers"][0]["attn_norm"] == P(None)  # vectors are not FSDP-sharded
    assert attn["q_norm"] == P(None)


def test_rollout_rules_keep_weights_whole_over_data_and_fsdp():
    s = _specs(_cfg(), sh.MeshConfig(data=2, fsdp=2, tensor=2), sh.ROLLOUT_RULES)
    assert s["layers"][0]["attn"]["wq"] == P(None, "tensor")
    assert s["layers"][0]["mlp"]["w_up"] == P(None, "tensor")


def test_fsdp_takes_the_largest_divisible_dim():
    s = _specs(_cfg(), sh.MeshConfig(fsdp=8), sh.TRAIN_RULES)
    assert s["layers"][0]["mlp"]["w_up"] == P(None, "fsdp")  # [64, 128]: F is larger
    assert s["layers"][0]["attn"]["wk"] == P("fsdp", None)  # [64, 32]: D is larger


def test_experts_shard_over_expert_axis():
    cfg = _cfg(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               architecture="Qwen3MoeForCausalLM")  # fmt: skip
    s = _specs(cfg, sh.MeshConfig(data=2, expert=4, fsdp=1), sh.TRAIN_RULES)
    assert s["layers"][0]["mlp"]["w_up"] == P("expert", None, None)
    # Non-expert matrices are FSDP-sharded over the expert axis (data parallel for them).
    assert s["layers"][0]["mlp"]["router"] == P("expert", None)
    assert s["layers"][0]["attn"]["wq"] == P("expert", None)
    rollout = _specs(cfg, sh.MeshConfig(data=2, expert=4, fsdp=1), sh.ROLLOUT_RULES)
    assert rollout["layers"][0]["attn"]["wq"] == P(None, None)
    assert rollout["layers"][0]["mlp"]["w_down"] == P("expert", None, None)


def test_fsdp_falls_back_to_a_shorter_axis_prefix():
    # [64, 32] over fsdp=4 x expert=4 = 16: 64 % 16 == 0 -> both; a [12, 8] matrix: fsdp only.
    spec = sh.spec_for((64, 32), (None, None), {"fsdp": 4, "expert": 4}, sh.TRAIN_RULES)
    assert spec == [("fsdp", "expert"), ()]
    spec = sh.spec_for((12, 8), (None, None), {"fsdp": 4, "expert": 4}, sh.TRAIN_RULES)
    assert spec == [("fsdp",), ()]


def test_indivisible_dims_fall_back_to_replication_with_one_warning(caplog):
    sh.specs._warned.clear()
    cfg = _cfg(vocab_size=63, num_heads=3, num_kv_heads=1)  # 63 % 2, 3 heads % 2
    with caplog.at_level(logging.WARNING, logger="fp8rl_jax.train.sharding"):
        s = _specs(cfg, sh.MeshConfig(data=4, tensor=2, fsdp=1), sh.ROLLOUT_RULES)
        _specs(cfg, sh.MeshConfig(data=4, tensor=2, fsdp=1), sh.ROLLOUT_RULES)
    assert s["embed"] == P(None, None)
    # [D, 3*16=48]: 48 divides 2, but TP must not split a head, and 3 heads don't.
    assert s["layers"][0]["attn"]["wq"] == P(None, None)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("embed[0:vocab]" in m and "replicated" in m for m in msgs)
    assert len(msgs) == len(set(msgs))  # each fallback logged once


def test_batch_axes_keep_the_longest_dividing_prefix():
    mesh = sh.abstract_mesh(sh.MeshConfig(data=2, fsdp=4), 8)
    assert sh.batch_shardings(jax.ShapeDtypeStruct((16, 3), jnp.int32), mesh).spec == P(
        ("data", "fsdp"), None
    )
    assert sh.batch_shardings(jax.ShapeDtypeStruct((6,), jnp.int32), mesh).spec == P("data")


def test_qarray_scales_follow_values_only_when_block_aligned():
    cfg = _cfg(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)
    w = jax.eval_shape(lambda p: quantize_params(p, QuantRecipe()), _abstract_weights(cfg))
    mesh = sh.abstract_mesh(sh.MeshConfig(data=2, fsdp=2, tensor=2), 8)
    out = sh.param_shardings(w, cfg, mesh, sh.TRAIN_RULES)
    up, wk = out["layers"][0]["mlp"]["w_up"], out["layers"][0]["attn"]["wk"]
    # QArray weights are [out, in] and shard like the [in, out] weight, dims swapped.
    w_up_spec = sh.param_specs(_abstract_weights(cfg), cfg, mesh, sh.TRAIN_RULES)["layers"][0]
    assert w_up_spec["mlp"]["w_up"] == P("fsdp", "tensor")
    # w_up [512, 256]: shards of 256 x 128 hold whole 128-blocks -> scales [4, 2] shard the same.
    assert up.values.spec == P("tensor", "fsdp") and up.scales.spec == P("tensor", "fsdp")
    # wk [2*64, 256]: a tensor shard of 64 rows is half a block -> that scale dim replicates.
    assert wk.values.spec == P("tensor", "fsdp") and wk.scales.spec == P(None, "fsdp")
    assert out["embed"].spec == P("tensor", "fsdp")  # not quantized: plain sharding


def test_weights_structure_mismatch_is_a_clear_error():
    cfg = _cfg()
    w = dict(_abstract_weights(cfg))
    w["value_head"] = jax.ShapeDtypeStruct((D, 1), jnp.float32)
    with pytest.raises(ValueError, match="does not match models.logical_axes"):
        _specs(cfg, sh.MeshConfig(fsdp=8), sh.TRAIN_RULES, weights=w)


def test_train_state_shardings_mirror_params_in_optimizer_state():
    cfg = _cfg()
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = jax.eval_shape(
        lambda: init_train_state(
            jax.tree.map(jnp.zeros_like, _abstract_weights(cfg)), opt, jax.random.key(0)
        )
    )
    mesh = sh.abstract_mesh(sh.MeshConfig(data=2, fsdp=2, tensor=2), 8)
    st = sh.train_state_shardings(state, cfg, mesh)
    adam = st.opt_state[1][0]
    assert adam.mu.policy["layers"][1]["attn"]["wq"].spec == P("fsdp", "tensor")
    assert adam.nu.policy == st.params and adam.mu.policy == st.params
    assert adam.count.spec == P() and st.step.spec == P() and st.rng.spec == P()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Rows:
    tokens_BT: jax.Array = batched()
    lens_B: jax.Array = batched()
    weights: jax.Array = batched()  # declared: split although its name has no B suffix
    q_LK: jax.Array  # not declared: replicated
    metrics: dict  # not declared: replicated


def test_batch_shardings_follow_declared_fields():
    mesh = sh.abstract_mesh(sh.MeshConfig(data=2, fsdp=4), 8)
    f32 = jnp.float32
    tree = _Rows(
        tokens_BT=jax.ShapeDtypeStruct((16, 12), jnp.int32),
        lens_B=jax.ShapeDtypeStruct((16,), jnp.int32),
        weights=jax.ShapeDtypeStruct((16, 3), f32),
        q_LK=jax.ShapeDtypeStruct((16, 2), f32),  # leading 16, but not a batch
        metrics={"kl": jax.ShapeDtypeStruct((), f32), "lens_B": jax.ShapeDtypeStruct((16,), f32)},
    )
    s = sh.batch_shardings(tree, mesh)
    assert s.tokens_BT.spec == P(("data", "fsdp"), None)
    assert s.lens_B.spec == P(("data", "fsdp"))
    assert s.weights.spec == P(("data", "fsdp"), None)
    assert s.q_LK.spec == P() and s.metrics["kl"].spec == P()
    assert s.metrics["lens_B"].spec == P()  # a name is not a declaration


@pytest.mark.parametrize("mode", ["none", "dynamic"])
def test_kv_cache_shardings(mode):
    cfg = _cfg()
    dtype = jnp.float32 if mode == "none" else jnp.float8_e4m3fn
    cache = jax.eval_shape(lambda: init_cache(cfg, 8, 32, dtype=dtype, mode=mode))
    mesh = sh.abstract_mesh(sh.MeshConfig(data=4, tensor=2, fsdp=1), 8)
    s = sh.kv_cache_shardings(cache, mesh)
    assert s.k[0].spec == P("data", None, "tensor", None)
    assert s.valid_BS.spec == P("data", None) and s.lengths_B.spec == P("data")
    if mode == "dynamic":
        assert s.k_scale[1].spec == P("data", "tensor", None)


def _qwen3_8b() -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=12288, qk_norm=True,
                       architecture="Qwen3ForCausalLM")  # fmt: skip


def _qwen3_30b_a3b() -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                       num_kv_heads=4, head_dim=128, intermediate_size=6144, qk_norm=True,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       architecture="Qwen3MoeForCausalLM")  # fmt: skip


def test_memory_estimate_qwen3_8b_worked_numbers():
    bf16 = memory_estimate(_qwen3_8b(), batch_size=256, seq_len=8192)
    fp8 = memory_estimate(_qwen3_8b(), batch_size=256, seq_len=8192, kv_cache_dtype="float8_e4m3fn")
    # Per layer: wq+wo 2*4096*4096, wk+wv 2*4096*1024, MLP 3*4096*12288, norms 2*4096 + 2*128.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert bf16.n_params == 36 * per_layer + 2 * 151936 * 4096 + 4096 == 8_190_735_360
    assert bf16.master_weights + bf16.optimizer_state + bf16.gradients == 16 * bf16.n_params
    assert bf16.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456  # 144 KiB
    assert fp8.kv_bytes_per_token == 73_728
    assert bf16.kv_cache == 147_456 * 256 * 8192  # 288 GiB
    per_dev = bf16.per_device(sh.MeshConfig(data=1, fsdp=8), 8)
    assert per_dev["train_state_gib"] == pytest.approx(16 * 8_190_735_360 / 8 / 2**30)
    assert per_dev["kv_cache_gib"] == pytest.approx(36.0)


def test_memory_estimate_qwen3_30b_a3b_worked_numbers():
    m = memory_estimate(_qwen3_30b_a3b(), batch_size=1, seq_len=1)
    per_layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2048 * 128 + 3 * 128 * 2048 * 768 + 4352
    assert m.n_params == 48 * per_layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624
    assert m.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2 == 98_304  # 96 KiB
    # FP8 rollout weights: 1 B per quantized weight (+4 B per 128x128 block), BF16 the rest.
    assert m.rollout_weights == pytest.approx(m.n_quantized + 2 * (m.n_params - m.n_quantized),
                                              rel=1e-3)  # fmt: skip
