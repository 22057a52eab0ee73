"""Autotuning on the device: time the candidates of an op at a shape once, cache the fastest.

The first time ``fp8_matmul(..., impl="auto")`` meets a shape on a real GPU/TPU with autotuning
on (``FP8RL_AUTOTUNE=1``; off by default, and always off in interpret mode and on CPU), it times
each candidate (the Pallas kernel's tile configs, the XLA FP8 path, and BF16 ``jnp.dot`` as the
floor) on random operands of that shape and records the choice under
``(device kind, jax version, op, shape)`` in a JSON cache: ``$FP8RL_AUTOTUNE_FILE`` (a file
beside the run) and the user cache ``~/.cache/fp8rl_jax/autotune.json``. Later calls read it.
The timer is injectable (``tune(..., timer=)``), so choosing and caching are deterministic and
tested on CPU; the default, ``device_timer``, takes the kernels' CUPTI time on a GPU. If the
BF16 floor beats every FP8 candidate the record says so (``fp8_slower_than_bf16``): the op
still runs its fastest FP8 candidate (its weights are FP8), and the caller (a model config)
learns that BF16 weights would be faster for that layer. The ops ask at trace time, inside the
jitted programs (tuned under ``jax.ensure_compile_time_eval``); with several ``jax.distributed``
processes, process 0's record is every process's (``lookup_or_tune``), so that every host
compiles the same program.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
USER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "fp8rl_jax", "autotune.json")
BF16_FLOOR = "bf16_floor"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the op: ``impl`` and ``config`` for the dispatcher, ``run`` to time it."""

    name: str  # unique, e.g. "pallas_mosaic_gpu:128x128x4"
    impl: str  # "pallas_mosaic_gpu" | "xla" | ... | BF16_FLOOR (timed, never chosen)
    config: object  # the impl's config (hashable) or None
    run: Callable[[], object]  # one call on prepared operands, result blocked on


def enabled() -> bool:
    return os.environ.get("FP8RL_AUTOTUNE", "0") == "1"


def random_like(key, shape: tuple[int, ...], dtype):
    """Standard-normal operands of ``shape`` in ``dtype`` for timing, generated and cast in one
    jitted program (XLA fuses the cast into the generator: no f32 copy of a cache-sized
    operand beside the program being traced)."""
    import jax.numpy as jnp

    return _random_maker(tuple(shape), jnp.dtype(dtype))(key)


@functools.cache
def _random_maker(shape: tuple[int, ...], dtype):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype))


def cache_paths() -> list[str]:
    """Where records are read (first hit wins) and written (all)."""
    run_file = os.environ.get("FP8RL_AUTOTUNE_FILE")
    return [p for p in (run_file, USER_CACHE) if p]


def key(device_kind: str, jax_version: str, op: str, shape: tuple) -> str:
    return f"{device_kind}|jax {jax_version}|{op}|" + ",".join(map(str, shape))


def load(paths: list[str]) -> dict:
    """Merged records of the cache files (earlier paths win)."""
    merged: dict = {}
    for path in reversed(paths):
        try:
            with open(path) as f:
                merged.update(json.load(f))
        except (OSError, ValueError):
            continue
    return merged


def save(paths: list[str], k: str, record: dict) -> None:
    for path in paths:
        data = load([path])
        data[k] = record
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def wall_timer(cand: Candidate, reps: int = 10) -> float:
    """Median wall seconds of ``reps`` calls after one warm-up (which also compiles)."""
    cand.run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cand.run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def device_timer(cand: Candidate, reps: int = 10, platform: str | None = None) -> float:
    """Median device seconds of ``reps`` calls on a GPU: the CUPTI durations of the kernels each
    call launches (``jax.experimental.mosaic.gpu.profiler.measure``), after one warm-up call.
    A decode-sized GEMM runs for 5-30 us, under the ~20-50 us a call's host dispatch and
    ``block_until_ready`` take: timed by the wall clock, every candidate would tie at the
    dispatch cost. Elsewhere, or where CUPTI records nothing, the wall clock (``wall_timer``)."""
    import jax

    if (platform or jax.devices()[0].platform) != "gpu":
        return wall_timer(cand, reps)
    cand.run()  # compiles and warms
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, ms = profiler.measure(cand.run, aggregate=True, iterations=reps)()
    except Exception:  # noqa: BLE001 - no CUPTI on this machine: the wall clock
        ms = None
    if ms is None:
        return wall_timer(cand, reps)
    ms = sorted(float(t) for t in (ms if isinstance(ms, list) else [ms]))
    return ms[len(ms) // 2] * 1e-3


def tune(candidates: list[Candidate], timer: Callable[[Candidate], float] = device_timer) -> dict:
    """Times every candidate (one that raises is recorded, not chosen); returns the record.
    Logs each candidate's time as it comes (a first use can take minutes: a compile each)."""
    times, errors = {}, {}
    for i, cand in enumerate(candidates, 1):
        try:
            times[cand.name] = float(timer(cand))
            log.info("autotune: %d/%d %s: %.1f us", i, len(candidates), cand.name,
                     times[cand.name] * 1e6)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a candidate that fails is out, not fatal
            errors[cand.name] = f"{type(e).__name__}: {str(e)[:200]}"
            log.info("autotune: %d/%d %s failed: %s", i, len(candidates), cand.name,
                     errors[cand.name])  # fmt: skip
    fp8 = {c.name: c for c in candidates if c.impl != BF16_FLOOR and c.name in times}
    if not fp8:
        raise RuntimeError(f"autotune: no candidate ran: {errors}")
    best = min(fp8, key=lambda n: (times[n], n))  # ties: by name, deterministic
    floor = times.get(next((c.name for c in candidates if c.impl == BF16_FLOOR), ""))
    return dict(
        choice=best, impl=fp8[best].impl, config=repr(fp8[best].config), times_s=times,
        candidates=[c.name for c in candidates],  # in the order given (the default first)
        errors=errors, fp8_slower_than_bf16=floor is not None and times[best] > floor,
    )  # fmt: skip


def lookup_or_tune(k: str, make_candidates: Callable[[], list[Candidate]], *, timer=device_timer,
                   paths: list[str] | None = None) -> dict:  # fmt: skip
    """The cached record of ``k``, or tune now and cache it.

    The ops ask at trace time, inside the jitted program that calls them (the rollout's
    ``generate``, a training step, a ``shard_map`` body): the candidates are made and timed
    under ``jax.ensure_compile_time_eval``, so that their operands are arrays and each run a
    real call on the device. Without it they are the program's tracers: each "run" only traces,
    and the timer would time tracing (or every candidate fail).

    With several processes (``jax.distributed``) every process must compile the same program:
    timed on each host, or read from each host's own cache, the choices could differ and the
    processes' collectives would no longer match (a hang). So process 0 alone looks up or
    tunes (on its local devices, its caches) and every process takes its record
    (``_broadcast_record``); the others neither time nor read nor write caches. A process 0
    that fails to tune says so to the others, and every process raises."""
    import jax

    paths = cache_paths() if paths is None else paths
    if jax.process_count() == 1:
        return _lookup_or_tune_here(k, make_candidates, timer, paths)
    record = None
    if jax.process_index() == 0:
        try:
            record = _lookup_or_tune_here(k, make_candidates, timer, paths)
        except Exception as e:  # noqa: BLE001 - the others wait on the broadcast: tell them
            record = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    record = _broadcast_record(k, record)
    if "error" in record:
        raise RuntimeError(f"autotune {k}: process 0 failed to tune: {record['error']}")
    return record


def _lookup_or_tune_here(k: str, make_candidates, timer, paths: list[str]) -> dict:
    import jax

    if (hit := load(paths).get(k)) is not None:
        return hit
    log.warning("autotune: tuning %s (first use of this shape on this device; recorded in %s)",
                k, ", ".join(paths))  # fmt: skip
    with jax.ensure_compile_time_eval():
        record = tune(make_candidates(), timer)
    save(paths, k, record)
    log.warning("autotune: %s -> %s", k, record["choice"])
    return record


SHARE_TIMEOUT_MS = 30 * 60 * 1000  # process 0 may be tuning: every candidate a compile and a run
_asked: dict[str, int] = {}  # per key, the records shared so far (same order on every process)


def _broadcast_record(k: str, record: dict | None) -> dict:
    """Process 0's ``record`` of ``k`` on every process (others pass None), through
    ``jax.distributed``'s key-value store, as jax shares compiled executables between hosts
    (``compiler.py``): a host-side exchange, legal at trace time (``multihost_utils``'
    device broadcast is not: it sets a mesh, refused inside ``jax.jit``)."""
    from jax._src import distributed

    client = distributed.global_state.client
    _asked[k] = n = _asked.get(k, 0) + 1
    name = f"fp8rl_jax/autotune/{k}/{n}"
    if record is not None:
        client.key_value_set_bytes(name, json.dumps(record, sort_keys=True).encode())
        return record
    return json.loads(client.blocking_key_value_get_bytes(name, SHARE_TIMEOUT_MS).decode())


_TABLE_HEAD = (
    "| op | {} | choice | its time (us) | default | default (us) | default / choice |\n"
    "|---|---|---|---|---|---|---|"
)


def _tuned_rows(call, ops: set[str], op: str, label: str | None = None) -> None:
    """Runs ``call`` (which tunes on first use) and prints one row per record it wrote for the
    ops ``ops``: the choice beside the default (the first candidate), labelled ``label`` (None:
    the record's shape); a failure or no new record (read from an earlier cache file, or
    nothing ran) prints one row saying so, and the stage goes on."""
    import jax

    before = set(load(cache_paths()))
    try:
        jax.block_until_ready(call())
    except Exception as e:  # noqa: BLE001 - one failed op must not end the stage
        print(f"| {op} | {label or ''} | failed: {type(e).__name__}: {str(e)[:200]} | | | | |")
        return
    recs = load(cache_paths())
    new = [k for k in recs if k.split("|")[2] in ops and k not in before]
    if not new:
        print(f"| {op} | {label or ''} | (no new record: see {cache_paths()}) | | | | |")
    for k in new:
        rec = recs[k]
        t, first = rec["times_s"], rec["candidates"][0]
        print(f"| {k.split('|')[2]} | {label or k.split('|')[3]} | {rec['choice']} | "
              f"{t[rec['choice']] * 1e6:.1f} | {first} | {t[first] * 1e6:.1f} | "
              f"{t[first] / t[rec['choice']]:.2f}x |")  # fmt: skip


def _attention_table() -> None:
    """Tune the decode attention kernels (``attention_autotune``) at the rollout's shapes:
    Qwen3-8B widths, FP8 caches with per-head scales, the dense kernel at B = 32 over 8K slots
    and the paged one at B = 64 over 4,096 slots a row (pages of 64 slots; on a TPU 128, its
    kernel's smallest); one row each: the choice beside the default tiling (the first
    candidate)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.decode_attention import decode_attention
    from kernels_pallas.paged_attention import paged_attention

    f8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    scale = jnp.ones((8,), jnp.float32)
    kw = dict(k_scale=scale, v_scale=scale, sm_scale=128**-0.5)
    y = 128 if jax.devices()[0].platform == "tpu" else 64  # pages: the TPU kernel's >= 128 slots
    x = 64 * 4096 // y  # 64 rows of 4,096 slots
    print(_TABLE_HEAD.format("shape"))
    cases = [
        ("decode_attention", "B=32 S=8192 H/K=32/8 fp8",
         lambda: decode_attention(jnp.ones((32, 32, 128), bf16), jnp.ones((32, 8192, 8, 128), f8),
                                  jnp.ones((32, 8192, 8, 128), f8), jnp.full((32,), 8192), **kw)),
        ("paged_attention", f"B=64 pages {4096 // y}x{y} H/K=32/8 fp8",
         lambda: paged_attention(jnp.ones((64, 32, 128), bf16), jnp.ones((x, y, 8, 128), f8),
                                 jnp.ones((x, y, 8, 128), f8), jnp.full((64,), 4096),
                                 jnp.arange(x, dtype=jnp.int32).reshape(64, x // 64), **kw)),
    ]  # fmt: skip
    for op, label, call in cases:
        _tuned_rows(call, {op}, op, label)


def _grouped_table() -> None:
    """Tune the grouped FP8 kernel (the MoE experts, ``grouped_fp8_matmul.tuning``) at
    Qwen3-30B-A3B's gate+up: a decode step of 64 sequences (512 rows) and a prefill chunk of
    8,192 tokens (65,536 rows); one row each: the choice beside the default (first candidate)."""
    import jax.numpy as jnp

    from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul, tuning
    from kernels_pallas.qarray import QArray

    f8, e, d, f = jnp.float8_e4m3fn, 128, 2048, 768
    w = QArray(jnp.ones((e, f, d), f8), jnp.ones((e, f // 128, d // 128), jnp.float32),
               (128, 128), jnp.bfloat16)  # fmt: skip
    print(_TABLE_HEAD.format("rows"))
    for rows in (512, 65536):
        x = QArray(jnp.ones((rows, d), f8), jnp.ones((rows, d // 128), jnp.float32), (128,),
                   jnp.bfloat16)  # fmt: skip
        sizes = tuning.even_sizes(rows, e)
        _tuned_rows(lambda x=x, sizes=sizes: grouped_fp8_matmul(x, (w, w), sizes), {tuning.OP},
                    tuning.OP, str(rows))  # fmt: skip


def _grouped_bf16_table() -> None:
    """Tune the BF16 grouped kernels (the MoE experts' training GEMMs,
    ``grouped_matmul.tuning``) at Qwen3-30B-A3B's gate at expert = 8: 4,096 live rows over 16
    local experts, K 2,048, N 768, forward and backward; one row per pass: the choice beside the
    pass's default (first candidate)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.grouped_fp8_matmul.tuning import even_sizes
    from kernels_pallas.grouped_matmul import grouped_matmul, tuning

    e, m, d, f = 16, 4096, 2048, 768
    x, w = jnp.ones((m, d), jnp.bfloat16), jnp.ones((e, d, f), jnp.bfloat16)

    def loss(a, b):
        return grouped_matmul(a, b, even_sizes(m, e)).astype(jnp.float32).sum()

    print(_TABLE_HEAD.format("rows"))  # tunes each pass on first use: a row per pass
    _tuned_rows(lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w), set(tuning.OPS.values()),
                "grouped_matmul")  # fmt: skip


def main() -> int:
    """``python -m kernels_pallas.autotune``: tune the decode attention kernels, the grouped FP8
    kernel (MoE experts), fp8_matmul and the BF16 grouped kernels (MoE training) at the target
    shapes on this device (``gpu_check.sh``'s autotune stage) and print the chosen tables
    (attention first: most of a long rollout's decode step; the training kernels last)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.fp8_matmul.api import fp8_matmul
    from kernels_pallas.quantize import quantize_weight

    os.environ["FP8RL_AUTOTUNE"] = "1"
    if jax.devices()[0].platform not in ("gpu", "tpu"):
        print(f"autotune: no GPU/TPU ({jax.devices()[0].platform}): nothing to tune")
        return 0
    _attention_table()  # a GPU's or a TPU's kernels
    print()
    _grouped_table()
    print()
    # Qwen3-8B gate|up at decode and prefill sizes, k/v_proj at decode (the split-K case); one
    # row is printed per shape as it is tuned, so a stage cut by its budget keeps what it did.
    shapes = [(16, 12288, 4096), (64, 12288, 4096), (16, 1024, 4096), (4096, 12288, 4096)]
    print("| M | N | K | choice | fastest FP8 (us) | BF16 floor (us) | FP8 slower than BF16 |")
    print("|---|---|---|---|---|---|---|")
    for m, n, k in shapes:
        wq = quantize_weight(jnp.ones((k, n), jnp.bfloat16))
        fp8_matmul(jnp.ones((m, k), jnp.bfloat16), wq)  # tunes on first use
        dev = jax.devices()[0]
        shape = (m, n, k, str(wq.values.dtype), "bfloat16", False)
        rec = load(cache_paths()).get(key(dev.device_kind, jax.__version__, "fp8_matmul", shape))
        if rec is None:
            print(f"| {m} | {n} | {k} | (not tuned on {dev.platform}) | | | |")
            continue
        t = rec["times_s"]
        print(
            f"| {m} | {n} | {k} | {rec['choice']} | {t[rec['choice']] * 1e6:.1f} | "
            f"{t.get(BF16_FLOOR, float('nan')) * 1e6:.1f} | {rec['fp8_slower_than_bf16']} |"
        )
    if jax.devices()[0].platform == "gpu":  # the training kernels last: rollout's come first
        print()
        _grouped_bf16_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
