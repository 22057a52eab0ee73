"""The tile ``fp8_matmul`` dispatches (``tile_choice.dispatch_config``): the rules for the fused
kernel, elsewhere the performance model's fastest candidate where it beats the rules' tile by
``MODEL_MARGIN`` calibrated and by the SASS model alone; legal at every shape, the autotuner's
first candidate, and numerically the reference in interpret mode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fp8_matmul import api, tile_choice, tuning
from kernels_pallas.fp8_matmul import mgpu_config as mc
from kernels_pallas.fp8_matmul.mgpu_config import MgpuConfig
from kernels_pallas.fp8_matmul.reference import fp8_matmul_reference
from kernels_pallas.perf_model import gpu
from kernels_pallas.quantize import quantize_activations, quantize_weight

# (N, K) of the rollout GEMMs in the model's tables: Qwen3-8B q|o, k|v, q|k|v, gate+up, down;
# Qwen3-30B-A3B o_proj; Llama-3-70B q|o, k|v, down; DeepSeek-V3 o_proj
SHAPES = ((4096, 4096), (1024, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (2048, 4096),
          (8192, 8192), (1024, 8192), (8192, 28672), (7168, 16384))  # fmt: skip


def _t(chip, m, n, k, cfg):
    return gpu.predict_matmul(chip, m, n, k, "fp8", config=cfg, in_program=True).time_s


@pytest.mark.parametrize("chip", ["h100", "h200"])
def test_the_fused_kernel_follows_the_rules_and_decode_rows_mostly_do(chip):
    """The fused (BF16 x) kernel's tiles are the rules' at 16 rows (no candidate wins by the
    margin) and above 64 (it runs there only with an explicit config). Up to 64 rows the model
    replaces the decode rules on one shape only: Qwen3-8B q|o_proj at 33-64 rows on the H100
    (64x64 swap tiles, unsplit, two slices a step, for 64x128 ones split in two: 1.07x)."""
    changed = set()
    for n, k in SHAPES:
        for m in (16, 128, 4096):
            assert tile_choice.dispatch_config(m, n, k, fused=True, chip=chip) == \
                mc.default_config(m, n, k, fused=True)  # fmt: skip
        for m in (1, 16, 33, 48, 64):
            if tile_choice.dispatch_config(m, n, k, chip=chip) != mc.default_config(m, n, k):
                changed.add((m, n, k))
    assert changed == ({(m, 4096, 4096) for m in (33, 48, 64)} if chip == "h100" else set())
    pick = tile_choice.dispatch_config(64, 4096, 4096, chip="h100")
    assert (pick.block_m, pick.block_n, pick.swap_ab, pick.split_k, pick.k_slices) == \
        (64, 64, True, 1, 2)  # fmt: skip


@pytest.mark.parametrize("chip", ["h100", "h200"])
@pytest.mark.parametrize("m", [16, 64, 65, 96, 128, 256, 384, 1024, 4096])
def test_the_models_fastest_where_it_beats_the_rule_by_the_margin_both_ways(chip, m):
    for n, k in SHAPES:
        for out_b in (2, 4):
            got = tile_choice.dispatch_config(m, n, k, out_itemsize=out_b, chip=chip)
            rule = mc.default_config(m, n, k, out_itemsize=out_b)
            order = tile_choice.ranked(m, n, k, out_itemsize=out_b, chip=chip)
            t_best, best = order[0]
            t_rule = _t(chip, m, n, k, rule)
            raw = functools.partial(tile_choice._sass_alone, chip, m, n, k)
            if got == rule:  # no candidate beats it by the margin both ways
                margin = tile_choice.MODEL_MARGIN
                assert all(t >= margin * t_rule or raw(c) >= margin * raw(rule) for t, c in order)
            else:  # the fastest that does
                t_got = _t(chip, m, n, k, got)
                assert t_got < tile_choice.MODEL_MARGIN * t_rule
                assert raw(got) < tile_choice.MODEL_MARGIN * raw(rule)
                assert all(raw(c) >= tile_choice.MODEL_MARGIN * raw(rule) for t, c in order
                           if t < t_got)  # fmt: skip
            assert t_best <= _t(chip, m, n, k, got)
            # legal as called (F32 out leaves fewer stages in the SMEM budget)
            assert mc.supports(m, k, n, got, fused=False, x_itemsize=1,
                               out_itemsize=out_b) is None  # fmt: skip
            assert got.pdl == (got.swap_ab and mc.decode_pdl())


def test_rules_grids_that_idle_the_sms_take_the_models_tile():
    """Hand-checked anchors. Qwen3-8B down_proj (N = 4096, K = 12288) at M = 256: the rules run
    2 x 32 = 64 CTAs of 128x128 (half of the 132 SMs, 96 K steps each); split-K by 2 summed in
    the cluster (128 CTAs, 48 steps) is predicted >= 1.3x faster. Llama-3-70B k|v_proj (N = 1024)
    at M = 384: 3 x 8 = 24 CTAs of 128x128 against 6 x 16 = 96 of 64x64 (6 stages)."""
    down = tile_choice.dispatch_config(256, 4096, 12288, chip="h100")
    assert (down.block_m, down.block_n, down.swap_ab, down.split_k, down.cluster_k) == \
        (128, 128, True, 2, True)  # fmt: skip
    rule = mc.default_config(256, 4096, 12288)
    assert (rule.swap_ab, rule.split_k) == (False, 1)
    assert _t("h100", 256, 4096, 12288, rule) / _t("h100", 256, 4096, 12288, down) >= 1.3
    kv = tile_choice.dispatch_config(384, 1024, 8192, chip="h100")
    assert kv == MgpuConfig(64, 64, 6)
    assert _t("h100", 384, 1024, 8192, mc.default_config(384, 1024, 8192)) / \
        _t("h100", 384, 1024, 8192, kv) >= 1.5  # fmt: skip


def test_a_pick_never_rests_on_the_calibrations_family_factors():
    """At 64 rows the calibrated model ranks a 64-row prefill tile over the decode rules' tile
    for Llama-3-70B down_proj (1.12x), a gain the SASS model alone reverses (0.98x): it comes
    from the swap-AB family's factor (1.15) against the prefill tiles' (1.01). The dispatch does
    not take that tile."""
    m, n, k = 64, 8192, 28672
    rule = mc.default_config(m, n, k)
    (t_best, best) = tile_choice.ranked(m, n, k)[0]
    raw = functools.partial(tile_choice._sass_alone, "h100", m, n, k)
    assert not best.swap_ab and rule.swap_ab and t_best < 0.95 * _t("h100", m, n, k, rule)
    assert raw(best) > raw(rule)
    got = tile_choice.dispatch_config(m, n, k)
    assert got != best and (got == rule or raw(got) < tile_choice.MODEL_MARGIN * raw(rule))


def test_the_chip_ranks_on_its_own_constants():
    assert tile_choice.chip_of("NVIDIA H200") == "h200"
    assert tile_choice.chip_of("NVIDIA H100 80GB HBM3") == tile_choice.chip_of("cpu") == "h100"
    # Qwen3-8B q|o_proj at M = 128: the H200's faster HBM favours 4 K chunks of 128 weight rows
    h100, h200 = (tile_choice.dispatch_config(128, 4096, 4096, chip=c) for c in ("h100", "h200"))
    assert h100 != h200
    assert _t("h200", 128, 4096, 4096, h200) <= _t("h200", 128, 4096, 4096, h100)
    assert _t("h100", 128, 4096, 4096, h100) <= _t("h100", 128, 4096, 4096, h200)


def test_without_the_profiles_the_rules_alone(monkeypatch):
    def missing(*a, **k):
        raise FileNotFoundError("sass_profiles.json")

    monkeypatch.setattr(gpu, "load_profiles", missing)
    tile_choice._dispatch.cache_clear()
    try:
        assert tile_choice.dispatch_config(256, 4096, 12288) == mc.default_config(256, 4096, 12288)
    finally:
        tile_choice._dispatch.cache_clear()


FUSED_M = (17, 24, 32, 40, 48, 64)


def _fused_vs_once(chip, m, n, k, in_program):
    """(fused default tile, quantize kernel + FP8-x dispatch tile), predicted."""
    fused = tile_choice.dispatch_config(m, n, k, fused=True, chip=chip)
    once = tile_choice.dispatch_config(m, n, k, chip=chip)
    return (gpu.predict_matmul(chip, m, n, k, "bf16", mode="fused", config=fused,
                               in_program=in_program).time_s,
            gpu.predict_matmul(chip, m, n, k, "bf16", mode="qarray", config=once,
                               in_program=in_program).time_s)  # fmt: skip


@pytest.mark.parametrize("chip", ["h100", "h200"])
def test_raw_x_runs_fused_at_17_to_64_rows_only_where_it_beats_quantizing_once(chip):
    """``fused_wins``: the fused kernel's dispatch tile beats the act_quantize launch + the FP8
    tile by ``MODEL_MARGIN``, calibrated and by the SASS model alone, in a program and
    standalone; the default prediction (``mode="default"``) then is the fused kernel's, else
    the quantize-once path's."""
    from kernels_pallas.perf_model import calibration

    margin, wins = tile_choice.MODEL_MARGIN, 0
    for n, k in SHAPES:
        for m in FUSED_M:
            want = True
            for in_program in (True, False):
                fused, once = _fused_vs_once(chip, m, n, k, in_program)
                with calibration.uncalibrated():
                    raw_fused, raw_once = _fused_vs_once(chip, m, n, k, in_program)
                want &= fused < margin * once and raw_fused < margin * raw_once
            assert tile_choice.fused_wins(m, n, k, chip=chip) == want, (m, n, k)
            assert api.fused_default(m, n, k, chip) == want
            default = gpu.predict_matmul(chip, m, n, k, "bf16")
            assert default.impl.startswith("mm_fused_swap") == want
            assert default.time_s == pytest.approx(fused if want else once)
            wins += want
    assert 0 < wins < len(SHAPES) * len(FUSED_M)  # the shape decides, not the row count


def test_fused_rows_follow_the_shape_and_the_chip():
    """Anchors: the narrow k|v_proj (N = 1024, launch-bound) runs fused at 32 and 64 rows on
    both chips; the wide short-K gate+up (N = 24576, K = 4096: x quantization issue-bound per
    CTA) never on the H100, at 32 rows on the H200; Qwen3-8B q|o_proj at 32 rows on the H100
    only. Rows that x would be padded for (17-31, 33-63) stay quantized once: standalone the
    pad is a launch of its own, as costly as the act_quantize launch saved."""
    fused = lambda chip, n, k: [m for m in FUSED_M if tile_choice.fused_wins(m, n, k, chip=chip)]
    assert fused("h100", 1024, 4096) == fused("h200", 1024, 4096) == [32, 64]
    assert (fused("h100", 24576, 4096), fused("h200", 24576, 4096)) == ([], [32])
    assert (fused("h100", 4096, 4096), fused("h200", 4096, 4096)) == ([32], [])
    assert not tile_choice.fused_wins(16, 4096, 4096) and not tile_choice.fused_wins(65, 1024, 4096)


def test_the_fused_tile_is_the_models_where_it_beats_the_rules_both_ways():
    """Qwen3-8B q|k|v fused (N = 6144) at 64 rows on the H100: the rules' fused tile (64x64,
    unsplit) re-quantizes x in 96 CTAs; the model's 64x128 split in 2 summed in the cluster
    quantizes half the K per CTA, and wins calibrated and SASS alone; legal for raw x."""
    m, n, k = 64, 6144, 4096
    rule = mc.default_config(m, n, k, fused=True)
    pick = tile_choice.dispatch_config(m, n, k, fused=True, chip="h100")
    assert (rule.block_n, rule.split_k) == (64, 1)
    assert (pick.block_n, pick.split_k, pick.cluster_k) == (128, 2, True)
    assert mc.supports(m, k, n, pick, fused=True, x_itemsize=2, out_itemsize=2) is None
    t = lambda c: tile_choice._predicted("h100", m, n, k, c, True)  # noqa: E731
    raw = lambda c: tile_choice._sass_alone("h100", m, n, k, c, True)  # noqa: E731
    assert t(pick) < tile_choice.MODEL_MARGIN * t(rule)
    assert raw(pick) < tile_choice.MODEL_MARGIN * raw(rule)


def test_without_the_profiles_raw_x_is_quantized_once(monkeypatch):
    def missing(*a, **k):
        raise FileNotFoundError("sass_profiles.json")

    monkeypatch.setattr(gpu, "load_profiles", missing)
    caches = (tile_choice._dispatch, tile_choice._fused_wins)
    for c in caches:
        c.cache_clear()
    try:
        assert not tile_choice.fused_wins(32, 1024, 4096)
        assert tile_choice.dispatch_config(32, 1024, 4096, fused=True) == mc.default_config(
            32, 1024, 4096, fused=True)  # fmt: skip
    finally:
        for c in caches:
            c.cache_clear()


def test_the_launch_setting_is_part_of_the_choice(monkeypatch):
    """``FP8RL_PDL=0`` after a first call still gives swap-AB picks launched plainly."""
    assert tile_choice.dispatch_config(256, 4096, 12288).pdl
    monkeypatch.setenv("FP8RL_PDL", "0")
    assert not tile_choice.dispatch_config(256, 4096, 12288).pdl


def test_candidates_are_legal_distinct_and_leave_out_the_pinned():
    m, n, k = 128, 4096, 4096
    legal = lambda c: mc.supports(m, k, n, c, fused=False, x_itemsize=1, out_itemsize=2) is None
    rule = mc.default_config(m, n, k)
    cands = tile_choice.candidates(m, n, k, legal, pinned=(rule,))
    assert rule not in cands and len(cands) == len(set(cands)) > 20
    assert all(legal(c) for c in cands)
    assert {c.swap_ab for c in cands} == {True, False}  # decode and prefill tiles both
    assert any(c.cluster_k for c in cands) and any(c.k_slices == 2 for c in cands)
    assert len({tile_choice.name(c) for c in cands}) == len(cands)  # names tell them apart


def test_the_autotuner_times_the_dispatch_tile_first_and_the_rules_beside_it():
    m, n, k = 256, 4096, 12288
    specs = tuning.tuning_specs(m, n, k, "gpu", limit=6, device_kind="NVIDIA H100 80GB HBM3")
    cfgs = [c for _, impl, c in specs if impl == "pallas_mosaic_gpu"]
    assert cfgs[0] == tile_choice.dispatch_config(m, n, k, chip="h100")
    assert mc.default_config(m, n, k) in cfgs  # pinned: the device judges the model's pick
    assert len(cfgs) == 6


def test_with_raw_x_the_autotuner_times_the_default_as_the_default_runs():
    """With BF16 x an explicit config runs the fused kernel wherever it takes the tile, while the
    default path quantizes x once (where ``fused_default`` says no, as at 128 rows): the
    default's spec carries no config, so it is timed and replayed through the default path
    (same tile)."""
    kind = "NVIDIA H100 80GB HBM3"
    raw, fp8 = (tuning.timed_specs(128, 4096, 4096, "gpu", kind, r) for r in (True, False))
    first = lambda specs: next(s for s in specs if s[1] == "pallas_mosaic_gpu")
    pick = tile_choice.dispatch_config(128, 4096, 4096)
    assert mc.fused_refuses(pick) is None  # the fused kernel would take it
    assert first(raw) == (tile_choice.name(pick), "pallas_mosaic_gpu", None)
    assert first(fp8) == (tile_choice.name(pick), "pallas_mosaic_gpu", pick)
    pallas = lambda specs: [c for _, impl, c in specs if impl == "pallas_mosaic_gpu"]
    assert pallas(raw).count(None) == 1 and None not in pallas(fp8)  # the others keep theirs
    fused16 = first(tuning.timed_specs(16, 4096, 4096, "gpu", kind, True))
    assert fused16[2] == mc.default_config(16, 4096, 4096, fused=True)  # runs fused either way


def test_where_raw_x_runs_fused_the_autotuner_times_quantizing_once_beside_it():
    """At 16 rows, and at 32 where the model fuses Qwen3-8B q|o_proj on the H100, every Pallas
    candidate runs fused: the quantize-once path (act_quantize, then the FP8-x dispatch tile)
    is timed beside them, last; not where the default already quantizes once (64 rows on the
    H100, 32 on the H200), nor for FP8 x."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    for m in (16, 32):
        name, impl, cfg = tuning.timed_specs(m, 4096, 4096, "gpu", h100, True)[-1]
        once = tile_choice.dispatch_config(m, 4096, 4096, chip="h100")
        assert (name, impl, cfg) == (tile_choice.name(once) + tuning.ONCE_SUFFIX,
                                     "pallas_mosaic_gpu", tuning.QuantizedOnce(once))  # fmt: skip
    for m, kind, raw in ((64, h100, True), (32, h200, True), (32, h100, False)):
        specs = tuning.timed_specs(m, 4096, 4096, "gpu", kind, raw)
        assert not any(isinstance(c, tuning.QuantizedOnce) for _, _, c in specs)


def test_the_quantize_once_candidate_computes_what_it_replays():
    """Its timed program (interpret mode) is ``act_quantize`` + the QArray kernel on its tile
    + the consumer, equal bit for bit to the fused default's timed program (the same FP8 codes
    and scales, the split-K sum fused into the add alike), and its replay to the fused
    default's output."""
    m, n, k = 32, 256, 512
    kx, kw, kr = jax.random.split(jax.random.key(5), 3)
    x = (jax.random.normal(kx, (m, k), jnp.float32) * 3.0).astype(jnp.bfloat16)
    wq = quantize_weight(jax.random.normal(kw, (k, n), jnp.float32))
    r = jax.random.normal(kr, (m, n), jnp.bfloat16)
    choice = tuning.QuantizedOnce(tile_choice.dispatch_config(m, n, k))
    got = tuning.timed_program("pallas_mosaic_gpu", choice, wq, jnp.bfloat16, interpret=True)(
        x, None, r)  # fmt: skip
    assert api.fused_default(m, n, k)  # the default runs fused here
    fused = tuning.timed_program("pallas_mosaic_gpu", None, wq, jnp.bfloat16, interpret=True)(
        x, None, r)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(fused, np.float32))
    replay = tuning.quantized_once(x, wq, choice, jnp.bfloat16, interpret=True)
    default = api.fp8_matmul(x, wq, impl="pallas_mosaic_gpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(replay, np.float32), np.asarray(default, np.float32))


@pytest.mark.parametrize("m,n,k", [(128, 512, 1024), (256, 256, 512)])
def test_the_dispatch_tile_computes_the_reference(m, n, k):
    """Interpret mode: where the model's tile differs from the rules' (swap-AB 64x64 tiles with
    split-K and two 128-K slices a step here), ``fp8_matmul`` without a config runs it and equals
    the reference and the rules' tile (F32 out)."""
    rule = mc.default_config(m, n, k, out_itemsize=4)
    assert tile_choice.dispatch_config(m, n, k, out_itemsize=4) != rule
    kx, kw = jax.random.split(jax.random.key(1))
    xq = quantize_activations(jax.random.normal(kx, (m, k), jnp.bfloat16), 128)
    wq = quantize_weight(jax.random.normal(kw, (n, k), jnp.bfloat16).T)
    want = fp8_matmul_reference(xq, wq, out_dtype=jnp.float32)
    got = api.fp8_matmul(xq, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu", interpret=True)
    ruled = api.fp8_matmul(
        xq, wq, out_dtype=jnp.float32, impl="pallas_mosaic_gpu", interpret=True, config=rule
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ruled), rtol=1e-5, atol=1e-4)


def test_the_report_shows_the_rules_the_pick_and_why(capsys):
    from kernels_pallas.perf_model import tile_report

    text = tile_report.report(256, 4096, 12288, top=3)
    lines = [r for r in text.splitlines() if r.startswith("| pallas")]
    tagged = {r.split("|")[-2].strip(): r.split("|")[1].strip() for r in lines}
    assert tagged["dispatch"] == tile_choice.name(tile_choice.dispatch_config(256, 4096, 12288))
    assert tagged["rules"] == tile_choice.name(mc.default_config(256, 4096, 12288))
    assert len(lines) == 4  # the top 3 (the pick first) and the rules' tile below them
    assert tile_report.main(["96", "6144", "4096", "--chip", "h200"]) == 0
    assert "on h200" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tile_report.main(["256", "4096", "1000"])  # K not a multiple of 128
    assert "K a positive multiple of 128" in capsys.readouterr().err


def test_the_raw_x_report_shows_the_fused_tiles_and_the_choice(capsys):
    """``--raw-x``: the fused kernel's ranked tiles, then both paths in the four columns
    ``fused_wins`` judges, the one that runs marked: fused for Qwen3-8B q|o_proj at 32 rows on
    the H100, quantized once at 64 on the H200 (the fused tile's split-K sum is a launch of
    its own standalone); outside 16-64 rows it says why there is nothing to show."""
    from kernels_pallas.perf_model import tile_report

    for m, chip, runs in ((32, "h100", "fused kernel"), (64, "h200", "act_quantize + QArray")):
        text = tile_report.raw_x_report(m, 4096, 4096, chip=chip, top=2)
        fused_tile = tile_choice.dispatch_config(m, 4096, 4096, fused=True, chip=chip)
        assert f"| {tile_choice.name(fused_tile)} |" in text
        marked = [r for r in text.splitlines() if r.endswith("| yes |")]
        assert len(marked) == 1 and marked[0].startswith(f"| {runs}")
    assert tile_report.main(["48", "1024", "4096", "--raw-x"]) == 0
    assert "raw BF16 x at M=48: quantized once" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tile_report.main(["128", "4096", "4096", "--raw-x"])
    assert "always quantized once" in capsys.readouterr().err
