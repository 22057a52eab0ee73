"""Subprocess of test_paged_sharded.py: the paged engine on 4 fake CPU devices vs one engine."""

from tests.cpu_devices import use_fake_cpu_devices

use_fake_cpu_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.generation import PagedConfig, SamplingConfig, make_prompts  # noqa: E402
from fp8rl_jax.generation.paged import generate_paged  # noqa: E402
from fp8rl_jax.train.sharding import MeshConfig, make_mesh  # noqa: E402
from tests.testing import TINY_MODEL, tiny_params  # noqa: E402

G, A = 2, 10
rng = np.random.default_rng(0)
rows = [rng.integers(6, TINY_MODEL.vocab_size, size=n).tolist() for n in (5, 9, 1, 7)]
prompts = make_prompts([r for r in rows for _ in range(G)])  # 8 requests, groups of 2
kw = dict(kv_cache_dtype="float32", max_new_tokens=A, stop_token_ids=(5,))
paged = PagedConfig(num_slots=2, page_size=4, num_pages=12)  # per device on the mesh


def run():
    return jax.jit(
        lambda w, p, k: generate_paged(w, p, TINY_MODEL, SamplingConfig(1.0), k, paged=paged, **kw)
    )(tiny_params(), prompts, jax.random.key(3))


one, m1 = run()
mesh = make_mesh(MeshConfig(data=2, fsdp=2))
with jax.set_mesh(mesh):
    four, m4 = run()
    hlo = (
        jax.jit(
            lambda w, p, k: generate_paged(
                w, p, TINY_MODEL, SamplingConfig(1.0), k, paged=paged, **kw
            )
        )
        .lower(tiny_params(), prompts, jax.random.key(3))
        .as_text()
    )
np.testing.assert_array_equal(four.tokens_BT, one.tokens_BT)
np.testing.assert_array_equal(four.response_lens_B, one.response_lens_B)
np.testing.assert_allclose(four.logp_BT, one.logp_BT, atol=1e-5)
for a, b in zip(jax.tree.leaves(four.qkv_amax), jax.tree.leaves(one.qkv_amax), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
assert "shard_map" in hlo or "sdy.manual_computation" in hlo, "no per-shard engine"
assert int(m4["engine_admissions"]) == int(m1["engine_admissions"]) == 8
assert int(m4["engine_unfinished"]) == 0
print("OK", int(m1["engine_peak_pages"]), int(m4["engine_peak_pages"]))
