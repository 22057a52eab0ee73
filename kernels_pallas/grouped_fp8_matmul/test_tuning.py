"""Autotuning of the Hopper grouped FP8 kernel's tiles: candidates, choice and cache with an
injected timer (CPU, the Hopper target as an abstract device: the support checks run, nothing
is timed on a GPU), and the op's hook."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas import autotune
from kernels_pallas.grouped_fp8_matmul import MgpuConfig, grouped_fp8_matmul
from kernels_pallas.grouped_fp8_matmul import tuning as tn
from kernels_pallas.qarray import QArray

F8 = jnp.float8_e4m3fn
_H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def _on_h100():
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=_H100))


def _sds(m, k, ns, e=128):
    """Qwen3-30B-A3B-shaped operands as ShapeDtypeStructs: FP8 x, stacks [E, N_i, K]."""
    sds = jax.ShapeDtypeStruct
    x = QArray(sds((m, k), F8), sds((m, k // 128), jnp.float32), (128,), jnp.bfloat16)
    ws = tuple(QArray(sds((e, n, k), F8), sds((e, n // 128, k // 128), jnp.float32), (128, 128),
                      jnp.bfloat16) for n in ns)  # fmt: skip
    return x, ws if len(ws) > 1 else ws[0], sds((e,), jnp.int32)


def test_candidates_around_the_default():
    """Decode-sized groups: the default swap tile first, the other swap tiles of 32 / 64 rows x
    128 / 64 weight rows, the default one stage deeper, the unswapped 128x128; prefill: the
    wide default, then 128x128, 256x128 and the 64-row swap tile. Every one legal, no repeats."""
    names = [tn.name(c) for c in tn.candidates(512, 2048, (768, 768), 128)]
    assert names == ["32x128/st4/swap", "32x64/st4/swap", "64x128/st4/swap", "64x64/st4/swap",
                     "32x128/st5/swap", "128x128/st4"]  # fmt: skip
    names = [tn.name(c) for c in tn.candidates(65536, 768, (2048,), 128)]
    assert names == ["128x256/st3", "128x128/st4", "256x128/st3", "64x128/st4/swap"]
    # an F32 output: the wide tile's ring is two stages; N = 384 takes no 256-wide tile
    assert tn.candidates(65536, 768, (2048,), 128, out_itemsize=4)[0] == MgpuConfig(128, 256, 2)
    assert all(c.block_n != 256 for c in tn.candidates(65536, 2048, (384,), 128))


def test_even_sizes():
    assert tn.even_sizes(10, 4).tolist() == [3, 3, 2, 2]
    assert tn.even_sizes(8, 128).sum() == 8


def test_tuned_config_times_each_candidate_once_and_caches_the_fastest(cache):
    run_file, inject = cache
    calls = inject({"128x128/st4": 0.5})
    x, w, gs = _sds(65536, 2048, (768, 768))
    with _on_h100():
        got = tn.tuned_config(x, w, gs, out_dtype=jnp.bfloat16, run=None)
        assert got == MgpuConfig(128, 128, 4)
        assert tn.tuned_config(x, w, gs, out_dtype=jnp.bfloat16, run=None) == got
    assert calls == ["128x256/st3", "128x128/st4", "256x128/st3", "64x128/st4/swap"]  # once
    rec = next(iter(json.loads(run_file.read_text()).values()))
    assert rec["choice"] == "128x128/st4" and rec["candidates"][0] == "128x256/st3"
    with _on_h100():  # another row count is another shape: tuned again
        tn.tuned_config(*_sds(4096, 2048, (768, 768)), out_dtype=jnp.bfloat16, run=None)
    assert len(calls) == 4 + 6


def test_the_op_asks_the_tuner_only_when_tuning_applies(monkeypatch):
    """``grouped_fp8_matmul(impl="auto")`` on a Hopper target takes the tuner's tile where
    autotuning applies (``enabled_for``) and never otherwise: an explicit config, the XLA impl,
    interpret mode or autotuning off (the default) skip it."""
    asked = []

    def tuned(x, w, gs, *, out_dtype, run):
        from kernels_pallas.backend import target_device
        from kernels_pallas.grouped_fp8_matmul import TpuConfig

        asked.append((x.shape, out_dtype))
        return MgpuConfig(128, 128, 4) if target_device().platform == "gpu" else TpuConfig()

    monkeypatch.setattr(tn, "tuned_config", tuned)
    x, w, gs = _sds(65536, 768, (2048,))
    call = lambda **kw: jax.eval_shape(lambda a, b, c: grouped_fp8_matmul(a, b, c, **kw),
                                       x, w, gs)  # noqa: E731  # fmt: skip
    with _on_h100():
        monkeypatch.delenv("FP8RL_AUTOTUNE", raising=False)
        call()  # off by default
        assert asked == []
        monkeypatch.setattr(
            tn,
            "enabled_for",
            lambda impl, config, interpret, chosen: (
                impl == "auto" and config is None and not interpret
            ),
        )  # a real device, say
        call(config=MgpuConfig(128, 256, 3))
        call(impl="xla")
        assert asked == []
        assert call().shape == (65536, 2048)
    with _on_v6e():  # the TPU kernel asks too
        assert call().shape == (65536, 2048)
    assert asked == [((65536, 768), jnp.bfloat16)] * 2


def test_autotune_stage_prints_the_grouped_choice_beside_the_default(cache, monkeypatch, capsys):
    """``python -m kernels_pallas.autotune``'s grouped table (``gpu_check.sh``'s autotune
    stage): one row per tuned shape from the record the call wrote, the default first."""
    import sys

    pkg = sys.modules["kernels_pallas.grouped_fp8_matmul"]  # the package (not its function)

    def fake_op(x, w, gs):  # as a tuning call would: write this shape's record
        k = autotune.key("H100", "0", tn.OP, (x.shape[0],))
        autotune.save(autotune.cache_paths(), k, dict(
            choice="128x128/st4", times_s={"128x256/st3": 2e-4, "128x128/st4": 1e-4},
            candidates=["128x256/st3", "128x128/st4"]))  # fmt: skip
        return jnp.zeros((x.shape[0], 1536), jnp.bfloat16)

    monkeypatch.setattr(pkg, "grouped_fp8_matmul", fake_op)
    monkeypatch.setattr(jnp, "ones", lambda shape, dtype=None: jax.ShapeDtypeStruct(shape, dtype))
    autotune._grouped_table()  # noqa: SLF001
    out = capsys.readouterr().out
    assert "| grouped_fp8_matmul | 512 | 128x128/st4 | 100.0 | 128x256/st3 | 200.0 | 2.00x |" in out
    assert "| grouped_fp8_matmul | 65536 | 128x128/st4 |" in out


_V6E = AbstractDevice(device_kind="TPU v6 lite", platform="tpu", num_cores=1)


def _on_v6e():
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=_V6E))


@pytest.mark.parametrize("fp8_mxu", [True, False])
@pytest.mark.parametrize("rows,k,ns", [(512, 2048, (768, 768)), (65536, 768, (2048,))])
def test_tpu_candidates_are_the_default_streamed_and_neighbour_plans(fp8_mxu, rows, k, ns):
    """On a TPU: the default plan first (no explicit tiles), then the streamed one (the default
    keeps each expert's weights in VMEM across its tiles: both are timed), then plans one step
    from the default; each legal, each a plan of its own, at most ``TUNE_LIMIT``."""
    from kernels_pallas.grouped_fp8_matmul import pallas_tpu as gtpu

    cands = tn.tpu_candidates(rows, k, ns, 128, fp8_mxu)
    plans = [gtpu.plan(rows, k, ns, 128, c, fp8_mxu=fp8_mxu) for c in cands]
    assert cands[0] == gtpu.TpuConfig() and 3 <= len(cands) <= tn.TUNE_LIMIT
    assert all(isinstance(p, gtpu.Plan) for p in plans) and len(set(plans)) == len(plans)
    assert gtpu.weight_reuse(plans[0], k, ns) and not gtpu.weight_reuse(plans[1], k, ns)


def test_tuned_config_on_a_tpu_names_plans_and_caches_the_fastest(cache):
    run_file, inject = cache
    calls = inject({"tpu:32x768x1024/native/p2": 0.5})
    x, w, gs = _sds(512, 2048, (768, 768))
    with _on_v6e():
        got = tn.tuned_config(x, w, gs, out_dtype=jnp.bfloat16, run=None)
    assert got == tn.tpu_candidates(512, 2048, (768, 768), 128, True)[1]  # the streamed plan
    assert calls[:2] == ["tpu:32x768x2048/native/p2", "tpu:32x768x1024/native/p2"]
    rec = next(iter(json.loads(run_file.read_text()).values()))
    assert rec["choice"] == "tpu:32x768x1024/native/p2" and rec["impl"] == "pallas_tpu"


def test_tpu_tuning_applies_only_on_a_real_tpu(monkeypatch):
    monkeypatch.setenv("FP8RL_AUTOTUNE", "1")
    assert not tn.enabled_for("auto", None, False, "pallas_tpu")  # this CPU
    assert not tn.enabled_for("auto", None, False, "xla")


def test_every_tpu_candidate_computes_the_product():
    """Each plan the TPU tuner times gives the reference's product (interpret mode, two groups
    over two stacks; power-of-two scales keep the dequantized BF16 operands exact): a candidate
    that computed something else could be chosen for its speed."""
    from kernels_pallas.grouped_fp8_matmul import grouped_fp8_matmul_reference
    from kernels_pallas.quantize import quantize_activations, quantize_weight

    m, k, ns, sizes = 96, 512, (256, 256), [40, 50]
    keys = jax.random.split(jax.random.key(3), 3)
    xq = quantize_activations(jax.random.normal(keys[0], (m, k)), 128)
    xq = QArray(xq.values, 2.0 ** jnp.ceil(jnp.log2(xq.scales)), xq.block_shape, xq.dtype)
    ws = tuple(quantize_weight(jax.random.normal(kk, (2, k, n)) + i, (128, 128), pow2_scales=True)
               for i, (kk, n) in enumerate(zip(keys[1:], ns, strict=True)))  # fmt: skip
    gs = jnp.asarray(sizes, jnp.int32)
    ref = np.asarray(grouped_fp8_matmul_reference(xq, ws, gs, out_dtype=jnp.float32))
    cands = tn.tpu_candidates(m, k, ns, 2, True)
    assert len(cands) >= 3
    for cfg in cands:
        y = grouped_fp8_matmul(xq, ws, gs, out_dtype=jnp.float32, impl="pallas_tpu", config=cfg,
                               interpret=True)  # fmt: skip
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)),
                                   err_msg=str(cfg))  # fmt: skip
