"""experiments/bench_matmul.py's arms, the model's prediction of each (perf_model.compare) and
the report's judgement of them (gpu_report.matmul_targets)."""

import dataclasses
import json

import pytest

from experiments import bench_matmul as bm
from experiments import gpu_report
from kernels_pallas.perf_model import compare, gpu


def test_quick_run_times_the_gemm_with_its_consumer_against_bf16_with_its_consumer(tmp_path):
    out = tmp_path / "bench_matmul.json"
    bm.main(["--quick", "--ms", "16", "--runs", "2", f"--out={out}"])
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bf16", "fp8:xla", "fp8:xla+quant", "bf16+add", "fp8:xla+add"}
    assert all("error" not in r for r in rows.values()), rows
    add, base = rows["fp8:xla+add"], rows["bf16+add"]
    # the speedup of a "+add" arm is over BF16 with the same consumer, not over the bare GEMM
    assert add["speedup_vs_bf16"] == pytest.approx(base["median_us"] / add["median_us"])
    assert rows["fp8:xla"]["speedup_vs_bf16"] == pytest.approx(
        rows["bf16"]["median_us"] / rows["fp8:xla"]["median_us"]
    )
    # and its error is against BF16 + r: the FP8 error of the GEMM (~0.03-0.05 relative to
    # ||y + r||), where against the bare BF16 GEMM it would be ~||r|| / ||y|| ~ 1
    assert base["rel_err_vs_bf16"] == 0.0
    assert 0 < add["rel_err_vs_bf16"] < 0.05
    assert 0 < rows["fp8:xla"]["rel_err_vs_bf16"] < 0.1
    # the wall clock's ratio beside CUPTI's (on CPU both are the wall clock)
    assert add["wall_speedup_vs_bf16"] == pytest.approx(
        base["wall_median_us"] / add["wall_median_us"])  # fmt: skip


def test_consumer_arms_only_at_decode_rows():
    labels = lambda m: [a[0] for a in bm._arms(["xla"], False, m)]
    assert labels(bm.ADD_MAX_M)[-2:] == ["bf16+add", "fp8:xla+add"]
    assert labels(bm.ADD_MAX_M + 1) == ["bf16", "fp8:xla", "fp8:xla+quant"]


@pytest.mark.parametrize(
    "n,saved",
    [  # Qwen3-30B-A3B o_proj: the decode tile splits K in 4, partials summed by XLA, a sum the
        # add absorbs (its launch saved); Qwen3-8B o_proj: 2 chunks summed in their cluster,
        # nothing after the kernel to absorb
        (2048, gpu.LAUNCH_S),
        (4096, 0.0),
    ],
)
def test_compare_predicts_the_consumer_arms_as_the_rollout_program(n, saved):
    """``+add``: the GEMM in the program (x FP8; a split tile's partial sum fused into the add,
    so no fusion launch of its own) plus the add's fusion (hand-computed: 3 x M x N x 2 bytes
    at an elementwise fusion's efficiency, one launch)."""
    m, k = 16, 4096
    add = 3 * m * n * 2 / (3.35e12 * gpu.ELEMENTWISE_BW_EFF) + gpu.LAUNCH_S
    assert gpu.add_fusion_s("h100", m, n) == pytest.approx(add)
    row = lambda impl: dict(m=m, n=n, k=k, impl=impl)
    fp8, fp8_add = (compare.predicted_us("h100", row(i)) for i in
                    ("fp8:pallas_mosaic_gpu", "fp8:pallas_mosaic_gpu+add"))  # fmt: skip
    assert fp8_add == pytest.approx(fp8 + (add - saved) * 1e6)
    bf16, bf16_add = (compare.predicted_us("h100", row(i)) for i in ("bf16", "bf16+add"))
    assert bf16_add == pytest.approx(bf16 + add * 1e6)
    assert compare.predicted_us("h100", row("fp8:xla+add")) is None  # not the kernel: no model


def test_report_judges_the_consumer_arm_as_the_in_program_target():
    rows = [dict(m=16, n=4096, k=4096, model="Qwen3-8B", layer="o_proj", impl=i, speedup_vs_bf16=s)
            for i, s in (("bf16", 1.0), ("fp8:pallas_mosaic_gpu", 1.5), ("bf16+add", 1.0),
                         ("fp8:pallas_mosaic_gpu+add", 1.7))]  # fmt: skip
    bench = {"meta": {"impls": ["xla", "pallas_mosaic_gpu"]}, "rows": rows}
    got = {r["target"]: (r["measured"], r["status"]) for r in
           gpu_report.matmul_targets(bench, on_gpu=True)}  # fmt: skip
    gemm = "fp8:pallas_mosaic_gpu GEMM / BF16, M <= 64"
    prog = "fp8:pallas_mosaic_gpu GEMM + residual add / BF16 + add (in program), M <= 64"
    assert got == {gemm: (1.5, "FAIL"), prog: (1.7, "PASS")}


def test_compare_prints_device_and_wall_time_beside_the_prediction(tmp_path):
    row = dict(m=16, n=4096, k=4096, impl="fp8:pallas_mosaic_gpu+add", median_us=6.0,
               wall_median_us=9.0)  # fmt: skip
    path = tmp_path / "bench_matmul.json"
    path.write_text(json.dumps({"meta": {"device_kind": "NVIDIA H100 80GB HBM3"}, "rows": [row]}))
    head, _, line = compare.rows_beside([str(path)])
    assert "wall (us)" in head
    pred = compare.predicted_us("h100", row)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3:] == ["6.0", "9.0", f"{pred:.1f}", f"{6.0 / pred:.2f}", f"{9.0 / pred:.2f}"]


def test_the_bench_times_the_tiles_before_overlap_and_k_slices_beside_the_default():
    """Where the Hopper default promotes under its wgmmas (``MgpuConfig.overlap``, prefill) or
    takes two 128-K slices per step (``k_slices``, decode), the bench also times the tiles
    before it (``:plain``), and every Hopper row records the config it ran, which ``compare``
    models; rows without one (the first device run) ran the tiles of then."""
    labels = lambda m, n, k: [a[0] for a in bm._arms(["xla", bm.MGPU], False, m, (n, k))]
    assert "fp8:pallas_mosaic_gpu:plain" in labels(4096, 4096, 4096)
    assert "fp8:pallas_mosaic_gpu:plain" in labels(16, 4096, 4096)  # decode: one slice a step
    assert "fp8:pallas_mosaic_gpu:plain" not in labels(4096, 4096, 384)  # 3 K slices: same
    assert "fp8:pallas_mosaic_gpu:plain" not in labels(16, 4096, 384)
    dec, dec_plain = (bm.arm_config(f"fp8:{bm.MGPU}{a}", 16, 4096, 4096) for a in ("", bm.PLAIN))
    assert (dec["k_slices"], dec_plain["k_slices"]) == (2, 1)
    legacy_decode = compare.matmul_config(dict(m=16, n=4096, k=4096, impl=f"fp8:{bm.MGPU}"))
    assert dataclasses.asdict(legacy_decode) == dict(dec_plain, pdl=False)  # launched plainly
    new, plain = (bm.arm_config(f"fp8:{bm.MGPU}{a}", 4096, 4096, 4096) for a in ("", bm.PLAIN))
    assert new["overlap"] and not plain["overlap"] and plain["block_n"] == 256
    assert bm.arm_config(f"fp8:{bm.MGPU}+quant", 4096, 4096, 4096) == new
    assert bm.arm_config("fp8:xla", 4096, 4096, 4096) is None
    row = dict(m=4096, n=4096, k=4096, impl=f"fp8:{bm.MGPU}")
    legacy, recorded = (compare.matmul_config(r) for r in (row, dict(row, config=new)))
    assert not legacy.overlap and legacy.block_n == 256 and recorded.overlap
    want = gpu.predict_matmul("h100", 4096, 4096, 4096, "fp8", config=recorded).time_s * 1e6
    assert compare.predicted_us("h100", dict(row, config=new)) == pytest.approx(want)
    assert compare.predicted_us("h100", row) > 1.1 * want  # the model's 1.12-1.20x


def test_the_bench_times_the_decode_default_launched_plainly_beside_it():
    """Decode tiles launch dependent by default (``MgpuConfig.pdl``): the ``:nopdl`` arm runs the
    same tile launched after its predecessor completes; prefill tiles launch plainly anyway."""
    labels = lambda m, n, k: [a[0] for a in bm._arms(["xla", bm.MGPU], False, m, (n, k))]
    assert "fp8:pallas_mosaic_gpu:nopdl" in labels(16, 4096, 4096)
    assert "fp8:pallas_mosaic_gpu:nopdl" not in labels(4096, 4096, 4096)
    dec, nopdl = (bm.arm_config(f"fp8:{bm.MGPU}{a}", 16, 4096, 4096) for a in ("", bm.NOPDL))
    assert dec["pdl"] and dict(dec, pdl=False) == nopdl
    # the model sees the launch: the same kernel, the gap it saves (gpu.PDL_LAUNCH_S)
    row = dict(m=16, n=4096, k=4096, impl=f"fp8:{bm.MGPU}")
    us = [compare.predicted_us("h100", dict(row, config=c)) for c in (dec, nopdl)]
    assert us[1] - us[0] == pytest.approx((gpu.LAUNCH_S - gpu.PDL_LAUNCH_S) * 1e6)


def test_the_bench_times_the_rules_tile_where_the_dispatch_model_replaced_it():
    """The default arm runs the dispatch's tile (``fp8_matmul.tile_choice``); where
    that is not the rules' tile, ``:rules`` times the rules' beside it (and records it), so a
    device run judges the model's pick; where they agree (M = 16, M = 4096) there is no such
    arm."""
    from kernels_pallas.fp8_matmul import mgpu_config, tile_choice

    labels = lambda m, n, k: [a[0] for a in bm._arms(["xla", bm.MGPU], False, m, (n, k))]
    assert "fp8:pallas_mosaic_gpu:rules" in labels(256, 4096, 12288)
    assert "fp8:pallas_mosaic_gpu:rules" not in labels(16, 4096, 4096)
    assert "fp8:pallas_mosaic_gpu:rules" not in labels(4096, 4096, 4096)
    got, rules = (bm.arm_config(f"fp8:{bm.MGPU}{a}", 256, 4096, 12288) for a in ("", bm.RULES))
    assert got == dataclasses.asdict(tile_choice.dispatch_config(256, 4096, 12288))  # CPU: H100's
    assert rules == dataclasses.asdict(mgpu_config.default_config(256, 4096, 12288))
    row = dict(m=256, n=4096, k=12288, impl=f"fp8:{bm.MGPU}")
    fast, slow = (compare.predicted_us("h100", dict(row, config=c)) for c in (got, rules))
    assert slow > 1.3 * fast  # the model's pick: 2 K chunks summed in-cluster, 128 CTAs not 64
