"""Expert-parallel MoE layer on 8 fake CPU devices vs one device; prints a JSON report.

Run by tests/test_moe_parallel.py in a subprocess (the fake device count is fixed when jax is
first imported): ``python -m tests.moe_parallel_worker [--mesh data=2,expert=4]``.
"""

from __future__ import annotations

import argparse
import re

from tests.cpu_devices import use_fake_cpu_devices


def _setup(mesh_text: str):
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models import ModelConfig, init_weights
    from fp8rl_jax.train import sharding as sh

    cfg = ModelConfig(
        vocab_size=64, hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        architecture="Qwen3MoeForCausalLM",
    )  # fmt: skip
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in mesh_text.split(","))}
    mesh = sh.make_mesh(sh.MeshConfig(**{"fsdp": 1, **sizes}))
    weights = init_weights(cfg, jax.random.key(0), jnp.float32, randomize_all=True)
    x = jax.random.normal(jax.random.key(1), (8, 3, cfg.hidden_size), jnp.float32)
    r = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)  # cotangent of the output
    return cfg, mesh, weights, x, r


def _fns(cfg):
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models.moe import moe_mlp

    def fwd(p, x):
        return moe_mlp(p, x, jnp.ones(x.shape[:2], bool), cfg)[0]

    def grads(p, x, r):
        return jax.grad(lambda p, x: jnp.sum(fwd(p, x) * r), argnums=(0, 1))(p, x)

    return jax.jit(fwd), jax.jit(grads)


def _f8_params(hlo: str) -> list[str]:
    """Shapes of the FP8 parameters of every computation of an HLO text."""
    return sorted(set(re.findall(r"(f8e4m3fn\[[\d,]*\])\{[\d,]*\} parameter\(", hlo)))


def _collectives(hlo: str) -> dict[str, list[str]]:
    """Collective op -> the result types (shapes) of its instructions in an HLO text."""
    ops = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    out: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        m = re.search(r"= (.+?) (" + "|".join(ops) + r")(?:-start)?\(", line)
        if m:
            out.setdefault(m.group(2), []).append(re.sub(r"\{[\d,]*\}", "", m.group(1)))
    return {k: sorted(set(v)) for k, v in sorted(out.items())}


def _diff(a, b) -> float:
    import jax
    import numpy as np

    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def run(mesh_text: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.models import moe
    from fp8rl_jax.quant import QuantRecipe, quantize_params
    from fp8rl_jax.train import sharding as sh
    from kernels_pallas.backend import KernelImpls

    cfg, mesh, weights, x, r = _setup(mesh_text)
    weights_q = quantize_params(weights, QuantRecipe())
    p, p_q = weights["layers"][0]["mlp"], weights_q["layers"][0]["mlp"]
    fwd, grads = _fns(cfg)
    ref_y, ref_g, ref_yq = fwd(p, x), grads(p, x, r), fwd(p_q, x)
    with jax.set_mesh(mesh):
        tok = sh.batch_shardings(x, mesh)
        ps = sh.param_shardings(weights, cfg, mesh, sh.TRAIN_RULES)["layers"][0]["mlp"]
        pqs = sh.param_shardings(weights_q, cfg, mesh, sh.ROLLOUT_RULES)["layers"][0]["mlp"]
        p_d, pq_d = jax.device_put(p, ps), jax.device_put(p_q, pqs)
        x_d, r_d = jax.device_put(x, tok), jax.device_put(r, tok)
        y, g, yq = fwd(p_d, x_d), grads(p_d, x_d, r_d), fwd(pq_d, x_d)
        hlo_ep = fwd.lower(pq_d, x_d).compile().as_text()
        # 6 tokens: split over data only (not 8-divisible), so each expert shard sees the same
        # tokens and the outputs are psum'ed instead of reduce-scattered.
        x6 = x[:2]
        y6 = fwd(p_d, jax.device_put(x6, sh.batch_shardings(x6, mesh)))

        def gspmd_only(p, x):  # the layer's steps without moe_parallel: GSPMD partitions them
            x_ND = x.reshape(-1, x.shape[-1])
            top_w, top_i, _ = moe.route(x_ND, p["router"], cfg)
            d = moe.dispatch(top_i, cfg.num_experts)
            return moe.combine(moe.experts(p, x_ND, d), top_w, d)

        hlo_gspmd = jax.jit(gspmd_only).lower(pq_d, x_d).compile().as_text()
        # BF16 experts through grouped_matmul's Hopper kernels (interpret mode) under the
        # expert-parallel shard_map: traced only (the interpreter runs one device), which is where
        # the custom VJP's cotangent types must match the expert-sharded weights'.
        kern = KernelImpls(expert_matmul="pallas_mosaic_gpu", interpret=True)
        bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (p_d, x_d, r_d))
        bf16_grads = jax.jit(jax.grad(
            lambda p, x, r: jnp.sum((moe.moe_mlp(p, x, jnp.ones(x.shape[:2], bool), cfg,
                                                 kern)[0] * r).astype(jnp.float32)),
            argnums=(0, 1),
        ))  # fmt: skip
        bf16_kernel_hlo = bf16_grads.lower(*bf).as_text()
        # The gathered 12 tokens of a shard in 3 dispatch chunks of 4 (moe_parallel.TOKEN_CHUNK)
        from fp8rl_jax.models import moe_parallel

        chunk, moe_parallel.TOKEN_CHUNK = moe_parallel.TOKEN_CHUNK, 4
        try:
            fwd_c, grads_c = _fns(cfg)  # new jits: traced with the small chunk
            y_c, g_c, yq_c = fwd_c(p_d, x_d), grads_c(p_d, x_d, r_d), fwd_c(pq_d, x_d)
            chunked_maps = fwd_c.lower(p_d, x_d).as_text().count("while")
        finally:
            moe_parallel.TOKEN_CHUNK = chunk
    n = mesh.shape["expert"]
    return {
        "y_scale": float(np.max(np.abs(np.asarray(ref_y)))),
        "g_scale": max(float(np.max(np.abs(np.asarray(v)))) for v in jax.tree.leaves(ref_g)),
        "max_y_diff": _diff(ref_y, y),
        "max_grad_diff": _diff(ref_g, g),
        "max_fp8_y_diff": _diff(ref_yq, yq),
        "max_y_diff_unsplit": _diff(fwd(p, x6), y6),
        "max_y_diff_chunked": _diff(ref_y, y_c),
        "max_grad_diff_chunked": _diff(ref_g, g_c),
        "max_fp8_y_diff_chunked": _diff(ref_yq, yq_c),
        "chunked_loops": chunked_maps,
        "fp8_y_scale": float(np.max(np.abs(np.asarray(ref_yq)))),
        "out_sharding": str(y.sharding.spec),
        "expert_shards": n,
        "num_experts": cfg.num_experts,
        # what the per-device programs see and send
        "ep_f8_params": _f8_params(hlo_ep),
        "ep_collectives": _collectives(hlo_ep),
        "gspmd_collectives": _collectives(hlo_gspmd),
        "bf16_kernel_grads_lowered": bool(bf16_kernel_hlo) and "ragged_dot" not in bf16_kernel_hlo,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="data=2,expert=4")
    args = parser.parse_args()
    # Must precede the first jax import: the CPU client's device count is fixed at start-up.
    use_fake_cpu_devices(8)
    import json

    print(json.dumps(run(args.mesh), indent=1))


if __name__ == "__main__":
    main()
