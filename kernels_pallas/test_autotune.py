"""Autotuning: choice, caching and the BF16 floor with an injected timer (CPU, no device)."""

import dataclasses
import json

import pytest

from kernels_pallas import autotune
from kernels_pallas.autotune import BF16_FLOOR, Candidate


def _cands(names_impls):
    return [Candidate(n, i, None, lambda: None) for n, i in names_impls]


def _timer(times):
    calls = []

    def timer(c):
        calls.append(c.name)
        if times[c.name] is None:
            raise ValueError("does not compile")
        return times[c.name]

    return timer, calls


def test_tune_picks_fastest_fp8_and_flags_bf16_floor():
    cands = _cands(
        [("xla", "xla"), ("k:128", "pallas"), ("k:64", "pallas"), (BF16_FLOOR, BF16_FLOOR)]
    )
    timer, _ = _timer({"xla": 3.0, "k:128": 1.5, "k:64": None, BF16_FLOOR: 2.0})
    rec = autotune.tune(cands, timer)
    assert rec["choice"] == "k:128" and rec["impl"] == "pallas"
    assert not rec["fp8_slower_than_bf16"] and "k:64" in rec["errors"]
    timer, _ = _timer({"xla": 3.0, "k:128": 2.5, "k:64": 2.5, BF16_FLOOR: 2.0})
    rec = autotune.tune(cands, timer)
    assert rec["choice"] == "k:128"  # a tie goes to the smaller name: deterministic
    assert rec["fp8_slower_than_bf16"]  # never chosen, but reported


def test_lookup_or_tune_caches_per_key(tmp_path, caplog):
    paths = [str(tmp_path / "run.json"), str(tmp_path / "user.json")]
    timer, calls = _timer({"a": 2.0, "b": 1.0})
    make = lambda: _cands([("a", "xla"), ("b", "pallas")])  # noqa: E731
    k = autotune.key("NVIDIA H100 80GB HBM3", "0.12.0.1", "fp8_matmul", (16, 4096, 4096))
    with caplog.at_level("INFO", logger="kernels_pallas.autotune"):
        assert autotune.lookup_or_tune(k, make, timer=timer, paths=paths)["choice"] == "b"
    # a first use says what it tunes, each candidate's time as it comes, and the choice
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith(f"autotune: tuning {k} (first use") and paths[0] in said[0]
    assert said[1:] == ["autotune: 1/2 a: 2000000.0 us", "autotune: 2/2 b: 1000000.0 us",
                        f"autotune: {k} -> b"]  # fmt: skip
    caplog.clear()
    assert autotune.lookup_or_tune(k, make, timer=timer, paths=paths)["choice"] == "b"
    assert calls == ["a", "b"] and not caplog.records  # the second call read the cache
    for p in paths:
        with open(p) as f:
            assert json.load(f)[k]["choice"] == "b"
    k2 = autotune.key("NVIDIA H200", "0.12.0.1", "fp8_matmul", (16, 4096, 4096))
    autotune.lookup_or_tune(k2, make, timer=timer, paths=paths)
    assert len(calls) == 4  # another device kind is another key


def test_tuning_inside_a_traced_program_runs_real_calls(tmp_path):
    """The ops ask for their tiles at trace time, inside the jitted program: the candidates'
    operands and runs must still be arrays and real calls, not the program's tracers (which
    the timer would time as tracing, or fail on)."""
    import jax
    import jax.numpy as jnp

    ran = []

    def make():
        x = jnp.arange(4.0) * 3  # operands built when tuning
        f = jax.jit(lambda a: a * 2)
        return [Candidate("a", "xla", None, lambda: ran.append(f(x).block_until_ready()))]

    def timer(c):
        c.run()
        return 1.0

    k = autotune.key("NVIDIA H100 80GB HBM3", "0", "op", (4,))

    @jax.jit
    def program(y):
        autotune.lookup_or_tune(k, make, timer=timer, paths=[str(tmp_path / "a.json")])
        return y + 1

    assert program(1.0) == 2.0
    assert not isinstance(ran[0], jax.core.Tracer)
    assert ran[0].tolist() == [0.0, 6.0, 12.0, 18.0]


def test_no_candidate_runs_raises():
    timer, _ = _timer({"a": None})
    with pytest.raises(RuntimeError, match="no candidate"):
        autotune.tune(_cands([("a", "xla")]), timer)


def test_off_by_default_and_gpu_specs_pass_the_support_check(monkeypatch):
    from kernels_pallas.fp8_matmul import tuning

    monkeypatch.delenv("FP8RL_AUTOTUNE", raising=False)
    assert not autotune.enabled()
    specs = tuning.tuning_specs(16, 4096, 4096, "gpu")
    names = [s[0] for s in specs]
    assert "xla" in names and BF16_FLOOR in names
    assert any(s[1] == "pallas_mosaic_gpu" and s[2].swap_ab for s in specs)
    assert len(set(names)) == len(names)


def test_timed_programs_feed_the_gemm_into_a_consumer():
    """Each candidate is timed as GEMM + a consumer (``y + r``), as in the model, so split-K sums
    fuse into it as in the rollout program: the FP8 candidates compute ``fp8_matmul + r``, the
    BF16 floor ``x wᵀ + r``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.fp8_matmul import fp8_matmul, tuning
    from kernels_pallas.quantize import quantize_activations, quantize_weight

    kx, kw, kr = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (16, 256), jnp.bfloat16)
    w = jax.random.normal(kw, (128, 256), jnp.bfloat16)
    r = jax.random.normal(kr, (16, 128), jnp.bfloat16)
    xq, wq = quantize_activations(x), quantize_weight(w.T)
    got = tuning.timed_program("xla", None, wq, jnp.bfloat16)(xq, None, r)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fp8_matmul(xq, wq, impl="xla") + r))
    floor = tuning.timed_program(BF16_FLOOR, None, wq, jnp.bfloat16)(x, w, r)
    want = jnp.dot(x, w.T, preferred_element_type=jnp.bfloat16) + r
    np.testing.assert_array_equal(np.asarray(floor), np.asarray(want))


def test_device_timer_takes_the_cupti_median_on_gpu_and_the_wall_clock_without_it(monkeypatch):
    from jax.experimental.mosaic.gpu import profiler

    runs = []
    cand = Candidate("k", "pallas_mosaic_gpu", None, lambda: runs.append(1))
    seen = {}

    def measure(f, *, aggregate, iterations):
        seen.update(aggregate=aggregate, iterations=iterations)
        return lambda: (f(), [3.0, 1.0, 2.0, 9.0, 2.5])  # ms per call

    monkeypatch.setattr(profiler, "measure", measure)
    assert autotune.device_timer(cand, reps=5, platform="gpu") == pytest.approx(2.5e-3)
    assert seen == dict(aggregate=True, iterations=5) and len(runs) == 2  # warm-up + the wrapped

    def no_cupti(f, **_):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(profiler, "measure", no_cupti)
    monkeypatch.setattr(autotune, "wall_timer", lambda c, reps: 7.0)
    assert autotune.device_timer(cand, reps=5, platform="gpu") == 7.0
    assert autotune.device_timer(cand, reps=5, platform="cpu") == 7.0  # no GPU: the wall clock


def test_the_device_times_the_default_and_the_models_fastest_configs():
    """``limit``: the default tile config (first) and the ``limit - 1`` legal others the
    performance model predicts fastest in a program; XLA and the BF16 floor always."""
    from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
    from kernels_pallas.fp8_matmul import tuning
    from kernels_pallas.perf_model import gpu

    m, n, k = 16, 1024, 4096
    every = tuning.tuning_specs(m, n, k, "gpu")
    kept = tuning.tuning_specs(m, n, k, "gpu", limit=4, device_kind="NVIDIA H200")
    assert [s[0] for s in kept[:2]] == ["xla", BF16_FLOOR] and len(kept) == 6
    default = mgpu.default_config(m, n, k)
    assert kept[2][2] == default == every[2][2] and default.max_concurrent_steps == 4
    assert kept[2][0] == "pallas_mosaic_gpu:32x128x4s/k8/s2"  # two 128-K slices per step
    # decode: the default's twins are always timed too: its one-slice tile (the default before
    # two-slice stages); no deeper ring here, for K chunks of 4 slices (split 8) fill 4 stages
    one = dataclasses.replace(default, k_slices=1)
    assert kept[3][2] == one == every[3][2] and kept[3][0] == "pallas_mosaic_gpu:32x128x4s/k8"
    t = lambda cfg: gpu.predict_matmul("h200", m, n, k, "fp8", config=cfg,  # noqa: E731
                                       in_program=True).time_s  # fmt: skip
    others = sorted(t(s[2]) for s in every[4:] if s[2] not in (default, one))
    assert sorted(t(s[2]) for s in kept[4:]) == others[:2]
    # q|k|v fused (N = 6144, 32 K steps): the deepest ring (tuning.DEEP_RING_STAGES) of the
    # default's two-slice 32x64 tile fits (6 x 24.25 KiB) and is pinned third
    qkv = tuning.tuning_specs(16, 6144, 4096, "gpu", limit=4, device_kind="NVIDIA H200")
    d = mgpu.default_config(16, 6144, 4096)
    assert [s[2] for s in qkv[2:5]] == [
        d, dataclasses.replace(d, k_slices=1),
        dataclasses.replace(d, max_concurrent_steps=tuning.DEEP_RING_STAGES)]  # fmt: skip
    assert len(every) > len(kept)
    # prefill: no twin (its ring is as deep as the SMEM allows), one pinned spec
    prefill = tuning.tuning_specs(4096, 4096, 4096, "gpu", limit=4, device_kind="NVIDIA H200")
    assert len(prefill) == 6 and not any(s[2] is not None and s[2].swap_ab for s in prefill[:3])


@pytest.mark.parametrize("kind", ["TPU v6 lite", "TPU v5 lite"])
@pytest.mark.parametrize("m", [16, 4096])
def test_tpu_specs_time_the_default_plan_and_its_neighbours(kind, m):
    """On a TPU the kernel's default plan (no config: replayed as the default runs) and up to
    ``TUNE_LIMIT - 1`` distinct plans one step from it, each accepted by ``plan``; on v6e
    (FP8 MXU) another compute mode among them. XLA and the BF16 floor as on a GPU."""
    from kernels_pallas.fp8_matmul import pallas_tpu as tpu
    from kernels_pallas.fp8_matmul import tuning

    n, k, fp8_mxu = 12288, 4096, tpu.has_fp8_mxu(kind)
    specs = tuning.tuning_specs(m, n, k, "tpu", device_kind=kind)
    assert [s[0] for s in specs[:3]] == ["xla", BF16_FLOOR, "pallas_tpu"]
    assert specs[2][2] is None and 3 < len(specs) <= 2 + tuning.TUNE_LIMIT
    default = tpu.plan(m, k, n, None, fp8_mxu=fp8_mxu)
    plans = [tpu.plan(m, k, n, cfg, fp8_mxu=fp8_mxu) for _, _, cfg in specs[3:]]
    assert all(isinstance(p, tpu.Plan) for p in plans)
    assert len({default, *plans}) == 1 + len(plans)  # each a plan of its own
    assert [s[0] for s in specs[3:]] == [tpu.plan_name(p) for p in plans]
    modes = {p.compute_dtype for p in plans}
    assert (len(modes - {default.compute_dtype}) > 0) == fp8_mxu


_WORKER = r"""
import json, os, sys
pid, port, run_file, user_file = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import jax.numpy as jnp
from kernels_pallas import autotune
from kernels_pallas.autotune import Candidate

# each process would choose differently on its own: other times, and process 1 a stale cache
times = [{"a": 2.0, "b": 1.0, "c": 3.0}, {"a": 1.0, "b": 2.0, "c": 3.0}][pid]
timed = []
def timer(c):
    c.run()
    timed.append(c.name)
    return times[c.name]
def make():
    x = jnp.arange(4.0)
    return [Candidate(n, "xla", None, lambda: (x * 2).block_until_ready()) for n in "abc"]
k = autotune.key("NVIDIA H100 80GB HBM3", "0", "op", (4,))
if pid == 1:
    autotune.save([user_file], k, {"choice": "c", "times_s": {"c": 0.1}})
paths = [run_file, user_file] if pid == 0 else [user_file]
got = []

@jax.jit
def program(y):  # asked at trace time, as the ops ask
    got.append(autotune.lookup_or_tune(k, make, timer=timer, paths=paths)["choice"])
    return y + 1

program(1.0)
def broken(c):
    raise ValueError("does not compile")
try:  # process 0 fails to tune: every process hears it and raises, none waits forever
    autotune.lookup_or_tune(k + "2", make, timer=broken, paths=paths)
    failed = ""
except RuntimeError as e:
    failed = str(e)
print(json.dumps({"choice": got[0], "timed": timed, "failed": "process 0 failed" in failed}))
"""


@pytest.mark.multiprocess
def test_processes_agree_on_process_zeros_choice(tmp_path):
    """Two ``jax.distributed`` processes (gloo on loopback) ask the tuner inside a jitted
    program, each with its own timings and process 1 with a stale cache: both take process
    0's choice (one program on every host: different choices would mismatch collectives),
    only process 0 times, and only its files get the record; a tuning that fails on process 0
    raises on both."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    repo = Path(__file__).resolve().parents[1]
    mine = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    env = {k: v for k, v in os.environ.items() if not k.startswith(mine)}
    env.update(PYTHONPATH=str(repo), JAX_PLATFORMS="cpu")
    files = [(tmp_path / f"run{i}.json", tmp_path / f"user{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(i), port, *map(str, files[i])],
                              cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert r0 == {"choice": "b", "timed": ["a", "b", "c"], "failed": True}
    assert r1 == {"choice": "b", "timed": [], "failed": True}  # not its cache, not its times
    assert json.loads(files[0][0].read_text()).popitem()[1]["choice"] == "b"
    assert json.loads(files[1][1].read_text()).popitem()[1]["choice"] == "c"  # untouched
    assert not files[1][0].exists()
