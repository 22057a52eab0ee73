"""One process of a multi-process RL run on CPU (jax.distributed + gloo), or its 1-process check.

Run by tests/test_multiprocess.py:
    # each of N processes (2 fake CPU devices each), all on one global mesh:
    python -m tests.multiprocess_worker --num-processes 2 --process-id I --port P \
        --mesh fsdp=2,tensor=2 --ckpt DIR --out OUT_I.json
    # 1 process, 1 device, plain rl.step programs; then restore DIR and compare:
    python -m tests.multiprocess_worker --num-processes 1 --devices 1 --restore DIR \
        --compare OUT_0.json --out REF.json
Each process builds only its own rows of the prompt batch and scores only its own rows.
"""

from __future__ import annotations

import argparse
import os

from tests.cpu_devices import use_fake_cpu_devices


def _parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def distributed_run(args) -> dict:
    import jax

    from fp8rl_jax.generation import Prompts
    from fp8rl_jax.train import distributed as dist
    from fp8rl_jax.train import sharding as sh
    from fp8rl_jax.train.checkpoint import CheckpointManager
    from tests import scaleout_common as sc

    cfg = sc.model_config(args.model)
    counter = sc.CompileCounter()
    mesh = sh.make_mesh(sh.MeshConfig(**{"fsdp": 1, **_parse_mesh(args.mesh)}))
    with jax.set_mesh(mesh):
        ro_fn, tr_fn = sc.programs(cfg, mesh)
        abstract = jax.eval_shape(lambda: sc.initial_state(cfg))
        state_sh = sh.train_state_shardings(abstract, cfg, mesh)
        # Every process computes the same initial state (same seed), placed straight on the mesh.
        state = jax.jit(lambda: sc.initial_state(cfg), out_shardings=state_sh)()
        tokens, lens = sc.prompts_np(0)
        n_rows = tokens.shape[0]
        prompts_sh = sh.batch_shardings(Prompts(tokens, lens), mesh)
        rewards_sh = sh.rows_sharding(n_rows, mesh)
        rows = dist.process_rows(prompts_sh.tokens_BP, tokens.shape)
        log_rows = []
        for t in range(args.steps):
            counter.active = t > 0
            tokens, lens = sc.prompts_np(t)  # a real loader would only read rows[...]
            prompts = dist.global_batch(Prompts(tokens[rows], lens[rows]), prompts_sh, n_rows)
            batch = ro_fn(state, prompts)
            tok, mask = dist.local_rows(batch.tokens_BT), dist.local_rows(batch.response_mask_BT)
            rewards = dist.global_batch(sc.rewards_np(tok, mask), rewards_sh, n_rows)
            state, m = tr_fn(state, batch, rewards)
            log_rows.append(sc.metrics_row(batch.metrics, m))
        counter.active = False
        with CheckpointManager(args.ckpt, max_to_keep=1) as ckpt:
            ckpt.save(args.steps, state, {"step": args.steps}, force=True)
            ckpt.wait_until_finished()
        params = dist.gather_to_host(state.params)
    if dist.is_main_process():
        import numpy as np

        np.savez(args.ckpt + ".params.npz", **sc.flat_params(params))
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "rows": [rows.start, rows.stop],
        "compiles_after_step0": counter.count,
        "metrics": log_rows,
    }


def reference_run(args) -> dict:
    import jax
    import numpy as np

    from fp8rl_jax.train import sharding as sh
    from fp8rl_jax.train.checkpoint import CheckpointManager
    from tests import scaleout_common as sc
    from tests.sharding_worker import run_reference

    cfg = sc.model_config(args.model)
    elapsed = sc.timer()
    rows, _, params = run_reference(cfg, args.steps)
    report = {"reference_s": elapsed(), "metrics": rows}
    if args.restore:
        abstract = jax.eval_shape(lambda: sc.initial_state(cfg))
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = sh.abstract_with_shardings(abstract, jax.tree.map(lambda _: one, abstract))
        with CheckpointManager(args.restore) as ckpt:
            restored = ckpt.restore_latest(target)
        got = sc.flat_params(restored.state.params)
        written = dict(np.load(args.restore + ".params.npz"))
        report["restored_step"] = restored.step
        report["restored_state_step"] = int(restored.state.step)
        report["restore_vs_written_max_diff"] = max(sc.max_diffs(written, got).values())
        report["restore_vs_reference_max_diff"] = max(sc.max_diffs(params, got).values())
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=12355)
    parser.add_argument("--devices", type=int, default=2, help="fake CPU devices per process")
    parser.add_argument("--mesh", default="fsdp=2,tensor=2")
    parser.add_argument("--model", default="dense", choices=("dense", "moe"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ckpt", default=None, help="checkpoint dir written by the N-process run")
    parser.add_argument("--restore", default=None, help="checkpoint dir to restore (1 process)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    use_fake_cpu_devices(args.devices)
    from tests import scaleout_common as sc

    if args.num_processes == 1:
        sc.dump(reference_run(args), args.out)
        return
    from fp8rl_jax.train import distributed as dist

    os.environ.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{args.port}",
        JAX_NUM_PROCESSES=str(args.num_processes),
        JAX_PROCESS_ID=str(args.process_id),
    )
    assert dist.maybe_initialize_distributed()
    sc.dump(distributed_run(args), args.out)


if __name__ == "__main__":
    main()
