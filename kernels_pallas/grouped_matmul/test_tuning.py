"""Autotuning of the Hopper BF16 grouped kernels' tiles, pass by pass: candidates, choice and
cache with an injected timer (CPU, the Hopper target as an abstract device: the support checks
run, nothing is timed on a GPU), and the op's hooks in the forward and the custom VJP."""

import json

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh

from kernels_pallas import autotune
from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.grouped_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.grouped_matmul import tuning as tn

BF16 = jnp.bfloat16
_H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
G = mgpu.GmmConfig


def _on_h100():
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=_H100))


def _names(cands):
    return [tn.name(c) for c in cands]


def test_candidates_per_pass():
    """Each pass's default first, then the other tiles its support check and SMEM budget take:
    Qwen3-30B-A3B's gate (K 2,048, N 768) takes all five in BF16; an f32 dw has no room for the
    wide tiles' 128 KiB output (the square default, then the 64-row tiles); N = 384 takes no
    256-wide tile."""
    wide = ["128x256x64/st3", "128x128x64/st4", "128x128x128/st3", "64x256x64/st4",
            "64x128x64/st4"]  # fmt: skip
    assert _names(tn.candidates("gmm", 2048, 768)) == wide
    assert _names(tn.candidates("gmm", 768, 2048)) == wide  # the input gradient's shapes
    assert _names(tn.candidates("tgmm", 2048, 768)) == wide
    f32 = _names(tn.candidates("tgmm", 2048, 768, out_dtype=jnp.float32))
    assert f32 == ["128x128x64/st4", "64x256x64/st4", "64x128x64/st4"]
    assert all("x256x" not in s for s in _names(tn.candidates("gmm", 2048, 384)))
    for kind, k, n in (("gmm", 2048, 768), ("tgmm", 2048, 768)):  # every one legal
        for c in tn.candidates(kind, k, n):
            assert mgpu.pass_reason(kind, k, n, c, 2, 2) is None


def test_pass_reason_names_the_dimension():
    """The input gradient contracts the forward's N: its refusal names N, not K."""
    assert "N=96" in mgpu.supports(256, 128, 96, BF16, G(64, 64, 64))
    reason = mgpu.pass_reason("gmm", 96, 128, G(64, 128, 64), 2, 2, dims=("N", "K"))
    assert reason == "N=96 must be a multiple of the tiles (64,) along it"


def test_each_pass_is_timed_once_and_caches_its_fastest(cache):
    run_file, inject = cache
    calls = inject({"128x128x128/st3": 0.5})
    sds = jax.ShapeDtypeStruct
    x, w, gs = sds((4096, 2048), BF16), sds((16, 2048, 768), BF16), sds((16,), jnp.int32)
    dy = sds((4096, 768), BF16)
    with _on_h100():
        fwd = tn.tuned_gmm(x, w, gs, transpose_w=False, out_dtype=BF16, run=None)
        assert fwd == G(128, 128, 128, 3)
        assert tn.tuned_gmm(x, w, gs, transpose_w=False, out_dtype=BF16, run=None) == fwd
        assert len(calls) == 5  # timed once; the second call read the cache
        inject({"64x256x64/st4": 0.25})
        dw = tn.tuned_tgmm(x, dy, gs, out_dtype=BF16, run=None)  # another op's record
        assert dw == G(64, 256, 64, 4) and len(calls) == 10
        tn.tuned_gmm(dy, w, gs, transpose_w=True, out_dtype=BF16, run=None)  # the input grad
        assert len(calls) == 15
    ops = sorted(k.split("|")[2] for k in json.loads(run_file.read_text()))
    assert ops == ["grouped_matmul_gmm", "grouped_matmul_gmm", "grouped_matmul_tgmm"]


def test_the_op_asks_the_tuner_per_pass_only_when_tuning_applies(monkeypatch):
    """``grouped_matmul(impl="auto")`` on a Hopper target runs the tuner's tile in each of its
    three passes where autotuning applies (``enabled_for``), and never otherwise: autotuning off
    (the default), an explicit config, the XLA impl or interpret mode skip it."""
    asked = []

    def gmm(x, w, gs, *, transpose_w, out_dtype, run):
        asked.append(("dgrad" if transpose_w else "fwd", x.shape))
        return G(128, 128, 64, 4)

    def tgmm(x, dy, gs, *, out_dtype, run):
        asked.append(("wgrad", x.shape))
        return G(64, 128, 64, 4)

    monkeypatch.setattr(tn, "tuned_gmm", gmm)
    monkeypatch.setattr(tn, "tuned_tgmm", tgmm)
    sds = jax.ShapeDtypeStruct
    x, w, gs = sds((4096, 2048), BF16), sds((16, 2048, 768), BF16), sds((16,), jnp.int32)

    def grads(**kw):
        loss = lambda a, b, g: grouped_matmul(a, b, g, **kw).astype(jnp.float32).sum()  # noqa: E731
        return jax.eval_shape(jax.grad(loss, argnums=(0, 1)), x, w, gs)

    with _on_h100():
        monkeypatch.delenv("FP8RL_AUTOTUNE", raising=False)
        grads()  # off by default
        assert asked == []
        monkeypatch.setattr(tn, "enabled_for", lambda impl, config, interpret: impl == "auto"
                            and config is None and not interpret)  # a real Hopper, say  # fmt: skip
        grads(config=G(128, 128, 64, 4))
        grads(impl="xla")
        assert asked == []
        dx, dw = grads()
    assert dx.shape == (4096, 2048) and dw.shape == (16, 2048, 768)
    assert asked == [("fwd", (4096, 2048)), ("dgrad", (4096, 768)), ("wgrad", (4096, 2048))]


def test_autotune_stage_prints_each_pass_beside_its_default(cache, monkeypatch, capsys):
    """``python -m kernels_pallas.autotune``'s BF16 grouped table (``gpu_check.sh``'s autotune
    stage): the training step's three passes tuned under one jitted gradient, one row per
    record it wrote, the choice beside the pass's default."""
    import sys

    pkg = sys.modules["kernels_pallas.grouped_matmul"]  # the package (not its function)

    def fake_op(x, w, gs):  # as the passes' tuners would: write their records
        for op in tn.OPS.values():
            k = autotune.key("H100", "0", op, (x.shape[0],))
            autotune.save(autotune.cache_paths(), k, dict(
                choice="64x256x64/st4", times_s={"128x256x64/st3": 3e-4, "64x256x64/st4": 1e-4},
                candidates=["128x256x64/st3", "64x256x64/st4"]))  # fmt: skip
        return x[:, :1] * w[0, :1, :]

    monkeypatch.setattr(pkg, "grouped_matmul", fake_op)
    autotune._grouped_bf16_table()  # noqa: SLF001
    out = capsys.readouterr().out
    for op in ("grouped_matmul_gmm", "grouped_matmul_tgmm"):
        assert f"| {op} | 4096 | 64x256x64/st4 | 100.0 | 128x256x64/st3 | 300.0 | 3.00x |" in out
