"""Subprocess of test_paged_sharded.py: the paged engine on 4 fake CPU devices vs one engine,
for the dense tiny model (data=2, fsdp=2) and for a tiny MoE whose expert stacks enter split over
``expert`` as the rollout layout places them (data=2, expert=2), its routing recorded."""

import dataclasses

from tests.cpu_devices import use_fake_cpu_devices

use_fake_cpu_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.generation import PagedConfig, SamplingConfig, make_prompts  # noqa: E402
from fp8rl_jax.generation.paged import generate_paged  # noqa: E402
from fp8rl_jax.train import sharding as sh  # noqa: E402
from tests.testing import TINY_MODEL, tiny_params  # noqa: E402

G, A = 2, 10
TINY_MOE = dataclasses.replace(
    TINY_MODEL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    architecture="Qwen3MoeForCausalLM",
)  # fmt: skip
rng = np.random.default_rng(0)
rows = [rng.integers(6, TINY_MODEL.vocab_size, size=n).tolist() for n in (5, 9, 1, 7)]
prompts = make_prompts([r for r in rows for _ in range(G)])  # 8 requests, groups of 2
kw = dict(kv_cache_dtype="float32", max_new_tokens=A, stop_token_ids=(5,))
paged = PagedConfig(num_slots=2, page_size=4, num_pages=12)  # per device on the mesh


def program(cfg, record):
    return jax.jit(
        lambda w, p, k: generate_paged(
            w, p, cfg, SamplingConfig(1.0), k, paged=paged, record_expert_ids=record, **kw
        )
    )


def check(cfg, mesh_cfg, record=False):
    weights = tiny_params(cfg)
    one, m1 = program(cfg, record)(weights, prompts, jax.random.key(3))
    mesh = sh.make_mesh(mesh_cfg)
    with jax.set_mesh(mesh):
        placed = jax.device_put(weights, sh.param_shardings(weights, cfg, mesh, sh.ROLLOUT_RULES))
        fn = program(cfg, record)
        four, m4 = fn(placed, prompts, jax.random.key(3))
        hlo = fn.lower(placed, prompts, jax.random.key(3)).as_text()
    np.testing.assert_array_equal(four.tokens_BT, one.tokens_BT)
    np.testing.assert_array_equal(four.response_lens_B, one.response_lens_B)
    np.testing.assert_allclose(four.logp_BT, one.logp_BT, atol=1e-5)
    for a, b in zip(jax.tree.leaves(four.qkv_amax), jax.tree.leaves(one.qkv_amax), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    if record:
        np.testing.assert_array_equal(four.expert_ids_BTLK, one.expert_ids_BTLK)
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo, "no per-shard engine"
    assert int(m4["engine_admissions"]) == int(m1["engine_admissions"]) == 8
    assert int(m4["engine_unfinished"]) == 0
    return int(m1["engine_peak_pages"]), int(m4["engine_peak_pages"])


dense = check(TINY_MODEL, sh.MeshConfig(data=2, fsdp=2))
moe_params = tiny_params(TINY_MOE)
w_up = sh.param_shardings(moe_params, TINY_MOE, sh.make_mesh(sh.MeshConfig(data=2, expert=2)),
                          sh.ROLLOUT_RULES)["layers"][0]["mlp"]["w_up"]  # fmt: skip
assert "expert" in str(w_up.spec), w_up.spec  # the experts do enter split over `expert`
moe = check(TINY_MOE, sh.MeshConfig(data=2, expert=2), record=True)
print("OK", dense, moe)
