"""The performance model against the first device run (H200, 2026-12-04): the fitted latency and
fill, the calibration factors, the quantization check, the measured rollout beside the model and
``compare``'s measured-beside-predicted tables."""

import dataclasses
import json
import os

import pytest

from kernels_pallas.perf_model import gpu, gpu_attention


def test_compare_reads_the_rows_there_are_and_names_a_missing_file(tmp_path):
    """A GPU check cut by its budget may not have written every bench file: the table keeps the
    rows of the ones there and says which is missing."""
    from kernels_pallas.perf_model import compare

    bench = tmp_path / "bench_matmul.json"
    row = dict(m=16, n=4096, k=4096, impl="bf16", median_us=9.0, wall_median_us=12.0)
    bench.write_text(json.dumps(dict(meta=dict(device_kind="NVIDIA H200"), rows=[row])))
    lines = compare.rows_beside([str(bench), str(tmp_path / "bench_decode.json")])
    want = compare.predicted_us("h200", row)
    assert f"| 9.0 | 12.0 | {want:.1f} | {9.0 / want:.2f} |" in lines[2]
    assert "bench_decode.json | (not read: FileNotFoundError)" in lines[3] and len(lines) == 4


def test_a_standalone_bf16_gemm_pays_the_kernel_fill_as_the_device_run_says():
    """``gpu.bf16_gemm_s``: a memory-bound BF16 GEMM timed on its own pays ``gpu.FILL_S``; on
    the device run's cuBLAS rows at M <= 256 that takes the measured / modelled spread from a
    coefficient of variation of 0.19 (median 1.26: the model too fast) to 0.11 (median 0.95);
    inside a program (``fill=False``) and compute-bound (M = 4096) it changes nothing."""
    from kernels_pallas.perf_model import calibration

    paths = [os.path.join(calibration.DEFAULT_DIR, f) for f in calibration.DEFAULT_FILES]
    without, with_ = calibration.baseline_fill(paths)
    assert (without["fill_s"], with_["fill_s"]) == (0.0, gpu.FILL_S)
    assert with_["cv"] < 0.12 < 0.18 < without["cv"]
    assert 0.9 < with_["median"] < 1.0 < 1.2 < without["median"]
    assert gpu.bf16_gemm_s("h200", 16, 4096, 4096) == pytest.approx(
        gpu.bf16_gemm_s("h200", 16, 4096, 4096, fill=False) + gpu.FILL_S)  # fmt: skip
    assert gpu.bf16_gemm_s("h200", 4096, 4096, 4096) == gpu.bf16_gemm_s("h200", 4096, 4096, 4096,
                                                                          fill=False)  # fmt: skip


def test_latency_and_fill_are_the_fit_to_the_device_run():
    """``gpu.DRAM_LATENCY_S`` and ``gpu.FILL_S`` are the grid point of ``calibration.fit`` whose
    decode-GEMM ratios (measured / modelled, 12 shapes) spread least but for a neighbour within
    0.005 of its coefficient of variation (1.0 us / 5 us: 0.078 against 0.081; 4 us is also the
    cuBLAS fixed cost the same run shows), well below the earlier guesses' 0.8 us / 1 us; the
    module's constants come back after the fit."""
    from kernels_pallas.perf_model import calibration

    paths = [os.path.join(calibration.DEFAULT_DIR, f) for f in calibration.DEFAULT_FILES]
    grid = {(round(r["latency_s"] * 1e7), round(r["fill_s"] * 1e6)): r for r in
            calibration.fit(paths)}  # fmt: skip
    assert (gpu.DRAM_LATENCY_S, gpu.FILL_S) == (1.0e-6, 4.0e-6)
    chosen, old = grid[(10, 4)], grid[(8, 1)]
    assert chosen["cv"] <= min(r["cv"] for r in grid.values()) + 0.005
    assert chosen["cv"] < 0.1 < 0.14 < old["cv"]
    assert chosen["max"] / chosen["min"] < 1.35 < 1.6 < old["max"] / old["min"]
    assert chosen["median"] == pytest.approx(gpu.KERNEL_CALIBRATION["mm_decode"], abs=0.005)


def test_prefill_steps_are_the_chain_in_step_and_a_later_wave_one_round_trip():
    """The first device run's prefill GEMMs (6 shapes at M = 4096, 4-12 waves of 32-128 K
    steps; 5 on 128x256 tiles, one on 128x64) against the model with the CTA's two compute
    warpgroups' MMAs in turn on each one's chain (``gpu.step_cycles``) and ``gpu.WAVE_S`` per
    later wave: measured / modelled 0.99-1.08, nothing fitted but the per-wave cost, whose grid
    (``fit_waves``) puts 1 us (one load round trip) at the least spread within 0.001. With each
    warpgroup's chain alone (the model before) the 128x256 rows were 1.36-1.48x slower than
    modelled, the 128x64 one 0.99x: the wide tiles' gap was their two waits per step."""
    from kernels_pallas.perf_model import calibration

    paths = [os.path.join(calibration.DEFAULT_DIR, f) for f in calibration.DEFAULT_FILES]
    v = calibration.ratios(paths)["mm_prefill"]
    assert len(v) == 6 and min(v) > 0.95 and max(v) < 1.1
    grid = {round(r["wave_s"] * 1e7): r["cv"] for r in calibration.fit_waves(paths)}
    assert gpu.WAVE_S == gpu.DRAM_LATENCY_S == 1.0e-6
    assert grid[10] <= min(grid.values()) + 0.001 and grid[10] < grid[40] - 0.01
    alone = dataclasses.replace  # each warpgroup's chain alone: one compute warpgroup's terms
    wide = gpu.load_profiles()["mm_qarray_128x256_c2"]
    loop = gpu.Loop(nwg=2, threads=384, wg_flops=2 * 64 * 256 * 128, fp8=True, waits=2,
                    step_bytes=0, stages=3)  # fmt: skip
    both, one = (gpu.step_cycles("h200", x, wide, 1, 132)["chain"]
                 for x in (loop, alone(loop, nwg=1)))  # fmt: skip
    assert both - one == pytest.approx(2 * 64 * 256 * 128 / 8192, rel=0.01)  # the other's MMAs
    assert 1.3 < both / one < 1.5


def test_attention_load_latency_is_the_one_both_caches_measured():
    """``gpu_attention.ATTN_LOAD_LATENCY_S`` is the median load round trip the swap-AB attention
    kernels' measured steps imply (``calibration.attention_latency``), and the FP8 (3 stages) and
    BF16 (2 stages) kernels imply the same one within 10%: one latency explains both caches'
    rates, so the ring depth, not the cache, set the FP8 kernel's 58-68% of HBM."""
    import statistics

    from kernels_pallas.perf_model import calibration

    paths = [os.path.join(calibration.DEFAULT_DIR, f) for f in calibration.DEFAULT_FILES]
    rows = [r for r in calibration.attention_latency(paths) if r["swap_ab"]]
    by = {c: statistics.median(r["latency_s"] for r in rows if r["cache"] == c)
          for c in ("fp8", "bf16")}  # fmt: skip
    assert len(rows) == 9 and by["fp8"] == pytest.approx(by["bf16"], rel=0.1)
    med = statistics.median(r["latency_s"] for r in rows)
    assert med == pytest.approx(gpu_attention.ATTN_LOAD_LATENCY_S, rel=0.05)
    assert gpu.KERNEL_CALIBRATION["attn_fp8"] == pytest.approx(1.0, abs=0.05)


def test_calibration_factors_are_the_device_runs_medians():
    """``gpu.KERNEL_CALIBRATION`` is what the stored H200 run gives (``calibration.factors``):
    a constant edited without new data, or data without the constant, fails; the baselines'
    stated efficiencies stay within 10% of that run's median; ``uncalibrated`` undoes it."""
    from kernels_pallas.perf_model import calibration

    paths = [os.path.join(calibration.DEFAULT_DIR, f) for f in calibration.DEFAULT_FILES]
    got = calibration.factors(paths)
    assert {k: v for k, v in got.items() if not k.startswith("baseline")} == \
        gpu.KERNEL_CALIBRATION  # fmt: skip
    assert all(0.9 <= v <= 1.1 for k, v in got.items() if k.startswith("baseline")), got
    cal = gpu.predict_matmul("h200", 4096, 4096, 4096, "fp8")
    with gpu.uncalibrated():
        raw = gpu.predict_matmul("h200", 4096, 4096, 4096, "fp8")
    kernel = lambda p: p.time_s - gpu.LAUNCH_S - p.terms["extra_s"]  # noqa: E731
    assert kernel(cal) == pytest.approx(gpu.KERNEL_CALIBRATION["mm_prefill"] * kernel(raw))
    assert cal.baseline_s == raw.baseline_s  # baselines are not scaled


def test_quantize_model_against_xla_measured_on_the_device(capsys):
    """``quantize_s("xla")`` (two reads of x, three launches, at the measured copy efficiency)
    is within 10% of what XLA's quantization took on the H200 at K = 4096-12288 (the ``+quant``
    row minus the kernel row: 31 us at [4096, 4096], 83 us at [4096, 12288]), and the one-read
    kernel's model is 0.5-0.6x of it: the reason raw x takes ``act_quantize`` at every M. The
    byte count by hand at [4096, 4096]: XLA 2·32 MiB + 16 MiB + 3·512 KiB, the kernel 48.5 MiB."""
    from kernels_pallas.perf_model import calibration

    paths = [os.path.join(calibration.DEFAULT_DIR, f) for f in calibration.DEFAULT_FILES]
    rows = calibration.quantize_check(paths)
    assert len(rows) == 6
    for r in rows:
        if "K=16384" not in r["label"]:  # DeepSeek-V3 o_proj: XLA beat its model (85 vs 108 us)
            assert r["xla_us"] == pytest.approx(r["measured_us"], rel=0.1), r
        assert 0.5 <= r["kernel_us"] / r["xla_us"] <= 0.6, r
    bw = gpu.CHIPS["h200"].hbm_bytes_per_s * gpu.QUANT_BW_EFF
    mib = 2**20
    want_xla = (2 * 32 * mib + 16 * mib + 3 * 512 * 1024) / bw + 3 * gpu.LAUNCH_S
    assert gpu.quantize_s("h200", 4096, 4096, "xla") == pytest.approx(want_xla)
    assert gpu.quantize_s("h200", 4096, 4096) == pytest.approx(48.5 * mib / bw + gpu.LAUNCH_S)
    assert calibration.main([]) == 0
    out = capsys.readouterr().out
    # down_proj: 552 us BF16 over 346 + 83 measured (1.29x), over 346 + 47 predicted (1.40x)
    assert "| Qwen3-8B down_proj M=4096 K=12288 | 82.8 | 82.3 | 47.4 | 1.29x | 1.40x |" in out
    # the attention rows' load round trip (``attention_latency``), each at its ring depth
    assert "| Qwen3-8B B=32 S=8192 fp8_static pallas_mosaic_gpu | 3 | 1.25 | 3.37 |" in out
    assert "| Qwen3-8B B=32 S=8192 bf16 pallas_mosaic_gpu | 2 | 1.89 | 3.48 |" in out


def test_calibrated_rollout_predicts_the_measured_one():
    """The end-to-end check the calibration was not fitted to: the H200 rollout (Qwen3-1.7B
    shape, static engine, B = 32, 1K prompt, 4K response) measured 1.25x BF16 per decode step;
    the calibrated model, from the kernel benchmarks alone, is within 10% of it (1.18x; the SASS
    model alone says 1.38x: the factors, all above 1, slow the FP8 kernels only)."""
    from kernels_pallas.perf_model import gpu_rollout

    v = gpu_rollout.validation()
    assert v["measured_ratio"] == pytest.approx(1.245, abs=0.01)
    assert v["calibrated"].ratio == pytest.approx(v["measured_ratio"], rel=0.1)
    assert v["raw"].ratio > v["calibrated"].ratio
    assert v["raw"].bf16_s == v["calibrated"].bf16_s


def test_a_qwen3_8b_rollout_file_is_predicted_at_its_own_shape(tmp_path):
    """``bench_rollout.py --model qwen3-8b`` (issue 21's target shape): the model predicts its
    decode step at the file's batch and mean context, the Qwen3-8B widths, the FP8 attention
    ring depth and the decode GEMM tiles it records and their launch (a file without them: the
    first run's 3 stages, one 128-K slice per step, launched plainly)."""
    import json

    from kernels_pallas.perf_model import gpu_rollout

    row = dict(batch=64, prompt_len=1024, new_tokens=4096, ms_per_step=10.0)
    data = dict(
        meta=dict(
            model="qwen3-8b",
            device_kind="NVIDIA H200",
            fp8_attention_stages=5,
            decode_k_slices=True,
            decode_pdl=True,
        ),
        rows=[dict(row, variant="bf16", ms_per_step=14.0), dict(row, variant="w8a8_fp8kv")],
    )
    path = tmp_path / "bench_rollout.json"
    path.write_text(json.dumps(data))
    v = gpu_rollout.validation(str(path))
    assert v["measured_ratio"] == pytest.approx(1.4)
    want = gpu_rollout.decode_step("h200", gpu_rollout.QWEN3_8B, 64, 1024 + 2048)
    assert v["calibrated"].ratio == pytest.approx(want.ratio)
    assert v["label"] == "Qwen3-8B shape, h200, B = 64, context 3,072"
    assert v["now"].ratio == pytest.approx(want.ratio)  # today's defaults: the same here
    for key in ("fp8_attention_stages", "decode_k_slices", "decode_pdl"):
        del data["meta"][key]
    path.write_text(json.dumps(data))
    old = gpu_rollout.decode_step("h200", gpu_rollout.QWEN3_8B, 64, 1024 + 2048, attn_stages=3,
                                  k_slices=False, pdl=False)  # fmt: skip
    assert gpu_rollout.validation(str(path))["calibrated"].ratio == pytest.approx(old.ratio)
    assert old.ratio < want.ratio  # the 3-stage ring: latency-bound on an H200


def test_compare_puts_a_measured_rollout_beside_the_rollout_model(capsys, tmp_path):
    """``compare`` given a bench_rollout JSON prints its decode step beside the model's (raw and
    calibrated); one its stage did not write is named, not a crash."""
    from kernels_pallas.perf_model import calibration, compare

    run = os.path.join(calibration.DEFAULT_DIR, "run1", "bench_rollout.json")
    assert compare.main([run, str(tmp_path / "bench_rollout.json")]) == 0
    out = capsys.readouterr().out
    assert "| measured (bench_rollout.py) | 3.56 | 4.43 | 1.25x |" in out
    assert "| model, calibrated |" in out and "not read: FileNotFoundError" in out


def test_attention_latency_reads_each_row_at_its_ring_depth(tmp_path):
    """A later run's rows (``bench_decode`` records ``num_stages``: the 5-stage default beside the
    ``:st3`` arm) are read at their own depth: the same measured time implies a round trip
    ``stages x step - chain``, so 5 stages at the same step imply 5/3 of 3 stages' (less the
    chain); rows without a time, ragged rows and the XLA reference give none."""
    from kernels_pallas.perf_model import calibration
    from kernels_pallas.perf_model.common import CHIPS

    base = dict(model="Qwen3-8B", b=32, s=8192, h=32, k=8, c=128, cache="fp8_static",
                lengths="full", median_us=150.0)  # fmt: skip
    rows = [
        dict(base, impl="pallas_mosaic_gpu", num_stages=5),
        dict(base, impl="pallas_mosaic_gpu:st3", num_stages=3),
        dict(base, impl="pallas_mosaic_gpu", lengths="ragged", num_stages=5),
        dict(base, impl="xla"),
        dict(base, impl="pallas_mosaic_gpu", median_us=None),
    ]
    path = tmp_path / "bench_decode.json"
    path.write_text(json.dumps(dict(meta=dict(device_kind="NVIDIA H200"), rows=rows)))
    got = calibration.attention_latency([str(path)])
    assert [r["stages"] for r in got] == [5, 3]
    five, three = got
    assert five["step_s"] == pytest.approx(three["step_s"])  # one CTA per row, same grid
    chain = 5 * five["step_s"] - five["latency_s"]
    assert chain == pytest.approx(3 * three["step_s"] - three["latency_s"])
    assert 0 < chain < 1000 / CHIPS["h200"].clock_hz  # the step's serial path, < 1000 cycles


def test_compare_models_a_bf16_x_row_as_it_ran():
    """A ``+quant`` row recorded ``fused`` (the fused decode kernel, M = 16) is modelled as
    one kernel with in-kernel quantization; rows without it (the first device run's, and
    ``+quant:once``) as the act_quantize launch and the QArray kernel: slower by the model."""
    from experiments import bench_matmul
    from kernels_pallas.perf_model import compare

    m, n, k = 16, 4096, 4096
    rows = {}
    for label in ("fp8:pallas_mosaic_gpu+quant", "fp8:pallas_mosaic_gpu+quant:once"):
        rows[label] = dict(m=m, n=n, k=k, impl=label,
                           config=bench_matmul.arm_config(label, m, n, k),
                           fused=bench_matmul.arm_fused(label, m, n, k))  # fmt: skip
    fused, once = rows.values()
    assert fused["fused"] and fused["config"]["block_m"] == 16
    assert not once["fused"] and once["config"]["block_m"] == 32
    t_fused, t_once = (compare.predicted_us("h100", r) for r in (fused, once))
    legacy = dict(m=m, n=n, k=k, impl="fp8:pallas_mosaic_gpu+quant")  # no "fused", no config
    assert t_fused < t_once and compare.predicted_us("h100", legacy) > t_fused
