"""Benchmark what a decode loop's control flow costs per iteration: the model's ``HOST_SYNC_S``.

The rollout model (``kernels_pallas/perf_model/gpu_rollout.py``) charges every predicate the host
reads in a decode step (a data-dependent ``while``'s, a ``conditional``'s branch index) at
``gpu.HOST_SYNC_S``. Three loops of ``n`` iterations, the same one-fusion body (a [rows, width]
f32 update), timed by the wall clock (host syncs are invisible to kernel timers):

* ``fori``: ``lax.fori_loop`` with a static trip count (XLA knows it: no predicate read);
* ``while``: ``lax.while_loop`` whose bound is an argument (the predicate is data);
* ``while+cond``: the same with a ``lax.cond`` on data in the body (a branch index per step).

Per iteration: ``while - fori`` is one loop predicate's cost, ``while+cond - while`` one branch
index's; the table prints them beside the model's assumption. On a CPU they say nothing about a
GPU (``--quick``: a smoke run). ``--out PATH.json`` (and the table in ``PATH.md``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import bench_common as bc  # noqa: E402
from kernels_pallas.perf_model import gpu  # noqa: E402

ROWS, WIDTH = 16, 4096  # one decode row block of a hidden vector


def _step(x):
    return x * 0.5 + 1.0


def loops() -> dict:
    """name -> jitted fn(x, n) running ``n`` (data) iterations of the same body."""

    def while_(x, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, _step(c[1])), (0, x))[1]

    def while_cond(x, n):
        def body(c):
            i, y = c
            y = jax.lax.cond(y[0, 0] > 0, _step, lambda v: v - 1.0, y)
            return i + 1, y

        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    return {"while": jax.jit(while_), "while+cond": jax.jit(while_cond)}


def per_iteration_s(call, n: int, reps: int) -> float:
    """Best of ``reps`` wall-clock runs of ``call()`` (``n`` iterations), per iteration; the
    first call (the compile) is not timed."""
    jax.block_until_ready(call())
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        best = min(best, time.perf_counter() - t0)
    return best / n


def measure(n: int, reps: int) -> dict:
    x = jnp.ones((ROWS, WIDTH), jnp.float32)
    # the trip count is a Python int: static, XLA knows it
    fori = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda i, y: _step(y), x))
    bound = jnp.int32(n)  # an argument: the loops' predicates are data
    times = {"fori": per_iteration_s(lambda: fori(x), n, reps)}
    for name, fn in loops().items():
        times[name] = per_iteration_s(lambda fn=fn: fn(x, bound), n, reps)
    return dict(
        iterations=n,
        per_iteration_us={k: v * 1e6 for k, v in times.items()},
        loop_predicate_us=(times["while"] - times["fori"]) * 1e6,
        branch_index_us=(times["while+cond"] - times["while"]) * 1e6,
        model_host_sync_us=gpu.HOST_SYNC_S * 1e6,
    )


def table(r: dict) -> str:
    rows = [[k, f"{v:.2f}"] for k, v in r["per_iteration_us"].items()]
    rows += [
        ["loop predicate (while - fori)", f"{r['loop_predicate_us']:.2f}"],
        ["branch index (while+cond - while)", f"{r['branch_index_us']:.2f}"],
        ["model: gpu.HOST_SYNC_S (predicted)", f"{r['model_host_sync_us']:.2f}"],
    ]
    return bc.md_table(["per iteration", "us"], rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 200 iterations")
    ap.add_argument("--iterations", type=int, default=None, help="loop length (GPU 4,096)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    n = args.iterations if args.iterations is not None else (200 if args.quick else 4096)
    if n < 1:
        ap.error(f"--iterations must be >= 1, got {n}")
    result = dict(device=jax.devices()[0].device_kind, **measure(n, reps=3 if args.quick else 5))
    print(table(result))
    if args.out:  # the JSON and, beside it, the table (scripts/gpu_check.sh's report shows it)
        out = pathlib.Path(args.out)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(f"## Host syncs ({result['device']})\n\n{table(result)}")
    return result


if __name__ == "__main__":
    main()
