"""Sharded vs single-device RL steps on fake CPU devices; writes a JSON report.

The fake device count is fixed when jax is imported, so tests/test_sharding_mesh.py runs this in
a subprocess, all cases in one process (one jax start-up, one report keyed by model):
    python -m tests.sharding_worker --quantize-check --rows-check \
        --case dense:data=2,fsdp=2,tensor=2 --case moe:data=2,expert=4
"""

from __future__ import annotations

import argparse

from tests.cpu_devices import use_fake_cpu_devices


def _parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def run_reference(cfg, steps: int):
    """Plain single-device programs from rl.step (no mesh)."""
    import jax.numpy as jnp
    import numpy as np

    from tests import scaleout_common as sc

    rollout_step, train_step = sc.programs(cfg)
    state = sc.initial_state(cfg)
    rows, tokens = [], []
    for t in range(steps):
        batch = rollout_step(state, sc.prompts_for(t))
        tok, mask = np.asarray(batch.tokens_BT), np.asarray(batch.response_mask_BT)
        state, m = train_step(state, batch, jnp.asarray(sc.rewards_np(tok, mask)))
        rows.append(sc.metrics_row(batch.metrics, m))
        tokens.append(tok)
    return rows, tokens, sc.flat_params(state.params)


def run_sharded(cfg, mesh_sizes: dict[str, int], steps: int, counter):
    import jax
    import numpy as np

    from fp8rl_jax.train import sharding as sh
    from tests import scaleout_common as sc

    mesh = sh.make_mesh(sh.MeshConfig(**{"fsdp": 1, **mesh_sizes}))
    with jax.set_mesh(mesh):
        ro_fn, tr_fn = sc.programs(cfg, mesh)
        state0 = sc.initial_state(cfg)
        state_sh = sh.train_state_shardings(state0, cfg, mesh)
        prompts_sh = sh.batch_shardings(sc.prompts_for(0), mesh)
        rewards_sh = sh.rows_sharding(sc.PROMPTS * sc.GROUP, mesh)
        state = jax.device_put(state0, state_sh)
        rows, tokens = [], []
        for t in range(steps):
            counter.active = t > 0  # step 0 compiles each program once; later steps must not
            batch = ro_fn(state, jax.device_put(sc.prompts_for(t), prompts_sh))
            tok, mask = np.asarray(batch.tokens_BT), np.asarray(batch.response_mask_BT)
            rewards = jax.device_put(sc.rewards_np(tok, mask), rewards_sh)
            state, m = tr_fn(state, batch, rewards)
            rows.append(sc.metrics_row(batch.metrics, m))
            tokens.append(tok)
        counter.active = False
    kept = jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state.params, state_sh.params
    )
    specs = jax.tree.map(lambda s: str(s.spec), state_sh.params)
    info = {
        "compiles_after_step0": counter.count,
        "cache_sizes": [ro_fn._cache_size(), tr_fn._cache_size()],
        "param_shardings_kept": all(jax.tree.leaves(kept)),
        "wq_spec": specs["layers"][0]["attn"]["wq"],
        "w_up_spec": specs["layers"][0]["mlp"]["w_up"],
        "sharded_leaves": sum(not s.is_fully_replicated for s in jax.tree.leaves(state_sh.params)),
    }
    return rows, tokens, sc.flat_params(state.params), info


def compare(cfg, meshes, steps: int) -> dict:
    import numpy as np

    from tests import scaleout_common as sc

    counter = sc.CompileCounter()
    elapsed = sc.timer()
    ref_rows, ref_tokens, ref_params = run_reference(cfg, steps)
    report = {"reference_s": elapsed(), "meshes": {}}
    for text in meshes:
        elapsed = sc.timer()
        counter.count = 0
        rows, tokens, params, info = run_sharded(cfg, _parse_mesh(text), steps, counter)
        metric_diff = max(max(sc.max_diffs(r, q).values()) for r, q in zip(ref_rows, rows))
        param_diff = sc.max_diffs(ref_params, params)
        report["meshes"][text] = {
            **info,
            "seconds": elapsed(),
            "tokens_equal": all(np.array_equal(a, b) for a, b in zip(ref_tokens, tokens)),
            "max_metric_diff": metric_diff,
            "max_param_diff": max(param_diff.values()),
            "worst_param": max(param_diff, key=param_diff.get),
            "metrics_step_last": rows[-1],
        }
    report["reference_metrics_step_last"] = ref_rows[-1]
    return report


def _all_reduce_max_elems(hlo: str) -> int:
    """Largest operand (elements) of any all-reduce in an HLO text (0 if none)."""
    import math
    import re

    sizes = [0]
    for line in hlo.splitlines():
        if " all-reduce(" in line:
            lhs = line.split(" all-reduce(")[0]
            for dims in re.findall(r"\w+\[([\d,]*)\]", lhs):
                sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return max(sizes)


def quantize_check() -> dict:
    """``quantize_params`` under jit on FSDP+TP-sharded, block-aligned weights: no collectives."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models import ModelConfig, init_weights
    from fp8rl_jax.quant import QuantRecipe, quantize_params
    from fp8rl_jax.train import sharding as sh

    cfg = ModelConfig(vocab_size=256, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=64, intermediate_size=512)  # fmt: skip
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        params = init_weights(cfg, jax.random.key(0), jnp.float32)
        p_sh = sh.param_shardings(params, cfg, mesh, sh.TRAIN_RULES)
        params = jax.device_put(params, p_sh)
        fn = jax.jit(lambda p: quantize_params(p, QuantRecipe()), in_shardings=(p_sh,))
        compiled = fn.lower(params).compile()
        hlo = compiled.as_text()
        out = fn(params)
        expect = sh.param_shardings(jax.eval_shape(fn, params), cfg, mesh, sh.TRAIN_RULES)
        pin = sh.rollout_params_constraint(cfg, mesh)
        pinned = jax.jit(lambda p: pin(quantize_params(p, QuantRecipe())), in_shardings=(p_sh,))
        rollout_wq = pinned(params)["layers"][0]["attn"]["wq"]
    same = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), out, expect)
    w_up = out["layers"][0]["mlp"]["w_up"]
    return {
        "gathers": [c for c in ("all-gather", "all-to-all", "collective-permute") if c in hlo],
        "all_reduce_max_elems": _all_reduce_max_elems(hlo),
        "out_shardings_match_rule": all(jax.tree.leaves(same)),
        "w_up_values_spec": str(w_up.values.sharding.spec),
        "w_up_scales_spec": str(w_up.scales.sharding.spec),
        "w_up_values_shard_shape": list(w_up.values.addressable_shards[0].data.shape),
        "rollout_wq_specs": [
            str(rollout_wq.values.sharding.spec),
            str(rollout_wq.scales.sharding.spec),
        ],  # fmt: skip
    }


def fused_check() -> dict:
    """The rollout forward with fused q|k|v and gate|up (``models.fused``) on a tensor=2 mesh:
    its logits against the unfused weights' on the same mesh (and both against one device: FP8
    activation rounding may flip where a sharded reduction's order differs), its weights'
    specs, and its collectives beside the unfused forward's (the split after each fused GEMM
    must add none)."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.models import ModelConfig, forward, init_weights
    from fp8rl_jax.models.fused import fuse_projections
    from fp8rl_jax.quant import QuantRecipe, quantize_params
    from fp8rl_jax.train import sharding as sh

    cfg = ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=128, intermediate_size=512, qk_norm=True)  # fmt: skip
    params = init_weights(cfg, jax.random.key(0), jnp.float32, randomize_all=True)
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size)
    ref = np.asarray(forward(quantize_params(params, QuantRecipe()), tokens, cfg).logits_BTV)
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, tensor=2))
    out = {}
    with jax.set_mesh(mesh):
        p_sh = sh.param_shardings(params, cfg, mesh, sh.TRAIN_RULES)
        params = jax.device_put(params, p_sh)
        pin = sh.rollout_params_constraint(cfg, mesh)
        tok_sh = sh.batch_shardings(tokens, mesh)
        for fuse in (False, True):

            def run(p, t, fuse=fuse):
                w = quantize_params(p, QuantRecipe())
                w = pin(fuse_projections(w, cfg) if fuse else w)
                return forward(w, t, cfg).logits_BTV, w

            fn = jax.jit(run, in_shardings=(p_sh, tok_sh))
            hlo = fn.lower(params, jax.device_put(tokens, tok_sh)).compile().as_text()
            logits, w = fn(params, jax.device_put(tokens, tok_sh))
            ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute")
            logits = np.asarray(logits)
            out["fused" if fuse else "unfused"] = {
                "max_logit_diff": float(np.max(np.abs(logits - ref))),
                "collectives": {c: len(re.findall(rf"= \S+ {c}\(", hlo)) for c in ops},
            }
            unfused = logits
            if fuse:
                out["fused_vs_unfused_sharded"] = float(np.max(np.abs(logits - unfused)))
                attn, mlp = w["layers"][0]["attn"], w["layers"][0]["mlp"]
                out["fused"]["wqkv_specs"] = [
                    str(attn["wqkv"].values.sharding.spec),
                    str(attn["wqkv"].scales.sharding.spec),
                ]
                out["fused"]["w_gate_up_specs"] = [
                    str(mlp["w_gate_up"].values.sharding.spec),
                    str(mlp["w_gate_up"].scales.sharding.spec),
                ]
    return out


def rows_check() -> dict:
    """The train program at fsdp=8 with 2 accumulated micro-batches and block remat: the row
    counts of its [rows, T, D] activations (forward and backward) in the compiled HLO.

    64 rows of T = 256 tokens: activations (rows·T·D) far outweigh the weights, so XLA's cost
    model keeps rows split wherever the program lets it (at a handful of tokens it may gather
    activations instead of reducing weight gradients, which is right at that size).
    """
    import dataclasses
    import re

    import jax
    import jax.numpy as jnp

    from fp8rl_jax.generation import Prompts
    from fp8rl_jax.rl import jit_steps
    from fp8rl_jax.train import sharding as sh
    from tests import scaleout_common as sc

    cfg = sc.model_config("dense")
    rollout_cfg, rl_cfg = sc.rl_configs()
    rl_cfg = dataclasses.replace(rl_cfg, grad_accum=2, remat="block")
    rows, T = 64, 256
    P = T - rollout_cfg.max_new_tokens
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=8))
    with jax.set_mesh(mesh):
        state = jax.eval_shape(lambda: sc.initial_state(cfg))
        prompts = Prompts(jax.ShapeDtypeStruct((rows, P), jnp.int32),
                          jax.ShapeDtypeStruct((rows,), jnp.int32))  # fmt: skip
        s = sh.step_shardings(cfg, rollout_cfg, rl_cfg, mesh, state, prompts)
        steps = jit_steps(cfg, rollout_cfg, rl_cfg, sc.optimizer(), shardings=s)
        batch = jax.eval_shape(steps.rollout, state, prompts)
        rewards = jax.ShapeDtypeStruct((rows,), jnp.float32)
        hlo = steps.train.lower(state, batch, rewards).compile().as_text()
    found = sorted({int(r) for r in re.findall(rf"\[(\d+),{T},{cfg.hidden_size}\]", hlo)})
    return {"micro_rows": rows // 2, "devices": 8, "activation_rows": found}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case", action="append", default=[], help="MODEL:MESH, e.g. dense:data=2,fsdp=2,tensor=2"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--quantize-check", action="store_true")
    parser.add_argument("--rows-check", action="store_true")
    parser.add_argument("--fused-check", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    # Must precede the first jax import: the CPU client's device count is fixed at start-up.
    use_fake_cpu_devices(args.devices)
    from tests import scaleout_common as sc

    report = {"quantize": quantize_check()} if args.quantize_check else {}
    if args.rows_check:
        report["rows"] = rows_check()
    if args.fused_check:
        report["fused"] = fused_check()
    meshes: dict[str, list[str]] = {}
    for case in args.case:
        model, mesh = case.split(":", 1)
        meshes.setdefault(model, []).append(mesh)
    for model, texts in meshes.items():
        report[model] = compare(sc.model_config(model), texts, args.steps)
    sc.dump(report, args.out)


if __name__ == "__main__":
    main()
