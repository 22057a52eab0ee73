"""The performance model: SASS parsing on a hand-written listing, the step formula's terms
against hand-computed cycles, and the table's invariants (no device, no compiler)."""

import dataclasses
import json

import pytest

from kernels_pallas.fp8_matmul import mgpu_config as mgpu
from kernels_pallas.perf_model import (
    common,
    gpu,
    gpu_attention,
    gpu_grouped,
    gpu_targets,
    sass,
    sass_profiles,
)

LISTING = """
        /*0100*/                   MOV R1, R2 ;
        /*0110*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0120*/                   FFMA R3, R4, R5, R3 ;
        /*0130*/               @P0 BRA 0x100 ;
        /*0140*/                   UTMALDG.2D [UR8], [UR10] ;
        /*0150*/                   BRA 0x140 ;
        /*0160*/                   EXIT ;
"""


def test_sass_main_loop_and_tma_loop():
    instrs = sass.parse_sass(LISTING)
    assert [i.op for i in instrs] == ["MOV", "QGMMA", "FFMA", "BRA", "UTMALDG", "BRA", "EXIT"]
    main = sass.main_loop(instrs)
    assert (main.start, main.end, main.total, main.mma, main.mma_shape) == (
        0x100,
        0x130,
        4,
        1,
        "64x128x32",
    )
    assert sass.tma_loop(instrs).total == 2
    assert main.under_mma == 2  # the FFMA and the branch issue while the MMA runs (no wait)


def test_sass_counts_what_issues_while_an_mma_group_runs():
    """``under_mma``: the non-MMA instructions between a group's first warpgroup MMA and the
    ``WARPGROUP.DEPBAR`` that waits for it (not the arrive/depbar themselves, not the MMAs)."""
    listing = """
        /*0100*/                   FFMA R3, R4, R5, R3 ;
        /*0110*/                   WARPGROUP.ARRIVE ;
        /*0120*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;
        /*0130*/                   UIADD3 UR4, UR4, 0x2, URZ ;
        /*0140*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0150*/                   FFMA R6, R88, R7, R6 ;
        /*0160*/                   FFMA R8, R89, R7, R8 ;
        /*0170*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0180*/                   FFMA R9, R24, R7, R9 ;
        /*0190*/               @P0 BRA 0x100 ;
"""
    main = sass.main_loop(sass.parse_sass(listing))
    assert (main.total, main.mma, main.under_mma) == (10, 2, 3)


def test_step_terms_hand_computed():
    """128x128 FP8 tile, 2 compute warpgroups: 2 x 64x128x128 MMAs at 8192 FLOP/clk = 512
    cycles; issue = (2 x 128 + 134) / 0.7; chain = both warpgroups' MMAs (they run in step)
    + 128 + the 124 other instructions / 0.7, of which the 20 issued while the MMAs run hide
    under them; a loop whose promotion runs under its MMAs (``overlap``: 150 of 226 under two
    waits of 2 x 512 cycles) hides only as many as the MMAs and waits last."""
    prof = {"main_loop": {"total": 128, "mma": 4, "under_mma": 20}, "tma_loop": {"total": 134}}
    loop = gpu.Loop(nwg=2, threads=384, wg_flops=2 * 64 * 128 * 128, fp8=True, waits=1,
                    step_bytes=256 * 128, stages=4)  # fmt: skip
    t = gpu.step_cycles("h100", loop, prof, c=1, active_sms=132)
    assert t["mma"] == pytest.approx(512, rel=1e-3)
    assert t["issue"] == pytest.approx((2 * 128 + 134) / gpu.ISSUE_EFF)
    assert t["chain"] == pytest.approx(512 + gpu.WGMMA_LATENCY + 104 / gpu.ISSUE_EFF, rel=1e-3)
    old = gpu.step_cycles("h100", loop, {**prof, "main_loop": {"total": 128, "mma": 4}}, 1, 132)
    assert old["chain"] == pytest.approx(t["chain"] + 20 / gpu.ISSUE_EFF, rel=1e-3)
    pair = dataclasses.replace(loop, wg_flops=2 * loop.wg_flops, waits=2)
    under = {"main_loop": {"total": 234, "mma": 8, "under_mma": 150}, "tma_loop": {"total": 134}}
    t = gpu.step_cycles("h100", pair, under, c=1, active_sms=132)
    assert t["chain"] == pytest.approx(1024 + 2 * gpu.WGMMA_LATENCY + 76 / gpu.ISSUE_EFF, rel=1e-3)
    busy = {"main_loop": {"total": 1208, "mma": 8, "under_mma": 1100}, "tma_loop": {"total": 134}}
    t = gpu.step_cycles("h100", pair, busy, c=1, active_sms=132)  # the issue outlasts the MMAs
    assert t["chain"] == pytest.approx((1100 + 100) / gpu.ISSUE_EFF, rel=1e-3)


def test_tma_step_counts_the_producer_per_k_step(tmp_path):
    """ptxas unrolls the producer warpgroup's K loop: two steps per iteration in the unsplit
    QArray kernels (6 TMA loads of 3 per step), completely for 4-8-step split-K chunks (no loop
    left: the same tile's per-step count is used), and a kernel whose compute loop issues the
    loads itself (no producer warpgroup: decode attention) charges none."""
    loop = lambda total, tma, mma=0: {"total": total, "mma": mma, "by_op": {"UTMALDG": tma}}
    two_steps = {"main_loop": loop(72, 0, 4), "tma_loop": loop(140, 6), "tma_loads": 3}
    assert gpu.tma_step_instructions(two_steps) == 70
    assert gpu.tma_step_instructions(dict(two_steps, tma_loop=loop(77, 3))) == 77
    assert gpu.tma_step_instructions(dict(two_steps, tma_loop=None)) is None
    no_producer = {"main_loop": loop(469, 2, 12), "tma_loop": loop(48, 2), "tma_loads": 2}
    assert gpu.tma_step_instructions(no_producer) == 0
    kernel = lambda main, tma: {"kernels": [{"main_loop": main, "tma_loop": tma,
                                             "registers": 168, "smem_bytes": 0}]}  # fmt: skip
    data = {"variants": {
        "mm_swap_16x64": dict(kernel(loop(72, 0, 4), loop(140, 6)), tma_loads=3),
        "mm_swap_16x64_k2": dict(kernel(loop(74, 0, 4), loop(77, 3)), tma_loads=3),
        "mm_swap_16x64_k4": dict(kernel(loop(75, 0, 4), None), tma_loads=3),
        "mm_swap_64x64_k8": dict(kernel(loop(111, 0, 4), None), tma_loads=3),
        "decode_fp8": dict(kernel(loop(618, 2, 12), loop(47, 2)), tma_loads=2),
    }}  # fmt: skip
    path = tmp_path / "sass.json"
    path.write_text(json.dumps(data))
    profs = gpu.load_profiles(str(path))
    steps = {name: p["tma_step"] for name, p in profs.items()}
    assert steps == {"mm_swap_16x64": 70, "mm_swap_16x64_k2": 77, "mm_swap_16x64_k4": 70,
                     "mm_swap_64x64_k8": 0.0, "decode_fp8": 0.0}  # fmt: skip
    # the issue term charges the producer's per-step count, not the two-step loop body
    lp = gpu.Loop(nwg=1, threads=256, wg_flops=2 * 64 * 16 * 128, fp8=True, waits=1,
                  step_bytes=80 * 128, stages=4)  # fmt: skip
    t = gpu.step_cycles("h100", lp, profs["mm_swap_16x64"], c=1, active_sms=64)
    assert t["issue"] == pytest.approx((72 + 70) / gpu.ISSUE_EFF)


def test_committed_profiles_charge_one_step_per_producer_iteration():
    """In the committed SASS profiles, every producer loop is normalised to one K step: no
    QArray matmul variant charges more than one step's TMA code (68-86 instructions; 54-55 for
    the fused decode tiles' two loads a step, x and w; 45-64 for the BF16 grouped kernels')."""
    for name, prof in gpu.load_profiles().items():
        if name.startswith("mm_fused_swap"):
            assert 50 <= prof["tma_step"] <= 60, (name, prof["tma_step"])
        elif name.startswith(("mm_qarray", "mm_swap", "mm_fused")):
            assert 60 <= prof["tma_step"] <= 90, (name, prof["tma_step"])
        elif name.startswith(("gmm_bf16", "tgmm_bf16")) and not name.endswith("_1wg"):
            assert 40 <= prof["tma_step"] <= 70, (name, prof["tma_step"])  # two loads a step
        if name.startswith(("decode_", "paged_")) or name.endswith("_1wg"):
            assert prof["tma_step"] == 0, name  # one warpgroup issues its own loads


def test_predictions_are_consistent():
    p = gpu.predict_matmul("h100", 4096, 4096, 4096, "fp8")
    q = gpu.predict_matmul("h200", 4096, 4096, 4096, "fp8")
    assert p.ratio == pytest.approx(p.baseline_s / p.time_s)
    assert q.time_s <= p.time_s  # same compute, more bandwidth
    a = gpu_attention.predict_attention("h100", "decode_attention", 32, 32768, 32, 8, 128)
    assert 0 < a.hbm_fraction() <= gpu.HBM_EFF + 1e-9  # never above the streaming ceiling
    assert "h100" in common.CHIPS and common.CHIPS["h100"].kind == "gpu"
    md = common.table([p, a])
    assert md.count("\n") == 3 and "fp8_matmul" in md


def test_swap_ab_attention_profiles_and_predictions():
    """The swap-AB decode kernels' committed SASS profiles: 64xNx16 wgmmas (N = 8: Qwen3-8B's
    group of 4 padded) against the unswapped 64x64x16, fewer main-loop instructions and
    registers, no spills; and no shape is predicted slower swapped."""
    profs = gpu.load_profiles()
    for name in ("decode_fp8", "decode_bf16", "paged_fp8"):
        sw, un = profs[name], profs[f"{name}_unswapped"]
        assert sw["main_loop"]["mma_shape"] == "64x8x16", name
        assert un["main_loop"]["mma_shape"] == "64x64x16", name
        assert sw["main_loop"]["total"] < 0.8 * un["main_loop"]["total"], name
        assert sw["registers"] < un["registers"] and sw["spill_bytes"] == 0, name
    for op in ("decode_attention", "paged_attention"):
        for chip in ("h100", "h200"):
            sw, un = (gpu_attention.predict_attention(chip, op, 8, 32768, 32, 8, 128, swap_ab=s)
                      for s in (True, False))  # fmt: skip
            assert sw.time_s <= un.time_s, (op, chip)
            assert sw.impl.split()[0] + "_unswapped" == un.impl.split()[0]


def test_grouped_bf16_against_the_dense_ragged_dot_baseline():
    """The baseline is XLA:GPU's dense expansion: e·m rows through a BF16 GEMM (hand-computed);
    our kernels compute only the live rows, so they win by about the dead work."""
    m, live, e, k, n = 32768, 4096, 16, 2048, 768
    dense = 2 * e * m * k * n / (common.CHIPS["h100"].bf16_flops_per_s * gpu.BF16_GEMM_EFF)
    assert gpu_grouped.dense_ragged_dot_s("h100", m, k, n, e, "fwd") == pytest.approx(
        dense + gpu.LAUNCH_S, rel=1e-6
    )
    for pass_ in ("fwd", "dgrad", "wgrad"):
        p = gpu_grouped.predict_grouped_bf16("h100", m, live, e, k, n, pass_)
        assert p.flops == 2 * live * k * n
        assert 1 < p.ratio < e * m / live  # never more than the dead work it skips
        assert p.terms["registers"] > 0
    # All rows live (no expert parallelism): the kernels' work grows, the baseline's does not.
    full = gpu_grouped.predict_grouped_bf16("h100", m, m, e, k, n, "fwd")
    assert full.time_s > gpu_grouped.predict_grouped_bf16("h100", m, live, e, k, n, "fwd").time_s


def test_rollout_step_sums_its_kernels():
    """The decode step is the per-layer kernels x layers + the LM head, with each program's
    measured count of other launches; both run q|k|v as one GEMM (XLA fuses BF16's three dots);
    inside the program a swap-AB GEMM's epilogue is fused into its consumer (no launch of its
    own). The KV cache at full length is hand-computed (B = 64: 2 x 36 layers x 64 rows x 6,144
    slots x 8 heads x 128 B = 27 GiB FP8)."""
    from kernels_pallas.perf_model import gpu_rollout as r
    from kernels_pallas.perf_model import hlo_launches

    cfg = r.QWEN3_8B
    p = r.decode_step("h100", cfg, 64, 4096)
    assert p.fp8_s == pytest.approx(sum(p.fp8_parts.values()))
    assert p.bf16_s == pytest.approx(sum(p.bf16_parts.values()))
    n = hlo_launches.load()
    other_fp8, other_bf16 = n["fp8"]["64"].per_layer["xla"], n["bf16"]["64"].per_layer["xla"]
    assert p.fp8_parts[f"{other_fp8} other fusions"] == pytest.approx(36 * other_fp8 * 2e-6)
    assert p.bf16_parts[f"{other_bf16} other fusions"] == pytest.approx(36 * other_bf16 * 2e-6)
    qkv = gpu.bf16_gemm_s("h100", 64, 6144, 4096, fill=False)  # inside the program
    assert p.bf16_parts["q|k|v (XLA fuses the dots)"] == pytest.approx(36 * qkv)
    # x arrives FP8 from its producer's kernel, one launch each (RMSNorm x2, combine, SiLU)
    alone = gpu.predict_matmul("h100", 64, 6144, 4096, "fp8")
    fused = gpu.predict_matmul("h100", 64, 6144, 4096, "fp8", in_program=True)
    assert alone.time_s == fused.time_s  # unsplit: the kernel writes y, nothing follows it
    assert p.fp8_parts["q|k|v fused"] == pytest.approx(36 * fused.time_s)
    # o_proj: the dispatch's pick (64x64 swap tiles, unsplit) writes y, nothing follows it; the
    # rules' tile (split 2, summed in-cluster) needs no sum after it either
    o_alone = gpu.predict_matmul("h100", 64, 4096, 4096, "fp8")
    o_prog = gpu.predict_matmul("h100", 64, 4096, 4096, "fp8", in_program=True)
    assert o_alone.time_s == o_prog.time_s and "split_k" not in o_prog.impl
    rules = mgpu.default_config(64, 4096, 4096)
    r_alone, r_prog = (gpu.predict_matmul("h100", 64, 4096, 4096, "fp8", config=rules,
                                          in_program=p) for p in (False, True))  # fmt: skip
    assert r_alone.time_s == r_prog.time_s and "in-cluster" in r_prog.impl
    assert p.fp8_parts["o_proj"] == pytest.approx(36 * o_prog.time_s)
    s_alone = gpu.predict_matmul("h100", 16, 2048, 4096, "fp8")  # split 4: partials summed
    s_prog = gpu.predict_matmul("h100", 16, 2048, 4096, "fp8", in_program=True)
    assert s_alone.time_s - s_prog.time_s == pytest.approx(gpu.LAUNCH_S)  # the sum's launch
    assert n["fp8"]["64"].per_layer["triton"] == 4
    producers = sum(gpu.quantize_s("h100", 64, k) for k in (4096, 4096, 4096, 12288))
    assert p.fp8_parts["4 producer+quantize kernels"] == pytest.approx(36 * producers)
    assert p.bf16_parts["(RMSNorm x2, combine, SiLU product: XLA fusions among the others)"] == 0
    # the host reads the decode loop's predicate once per step (the static loop has no cond)
    assert n["fp8"]["64"].host_syncs == n["bf16"]["64"].host_syncs == 1
    assert p.fp8_parts["1 host syncs"] == p.bf16_parts["1 host syncs"] == 10e-6
    assert p.kv_fp8_gib == pytest.approx(2 * 36 * 64 * 6144 * 8 * 128 / 2**30)
    assert p.kv_bf16_gib == 2 * p.kv_fp8_gib
    # the KV read dominates a 4K-context step: FP8 halves it, so the step ratio tends to ~2
    assert 1.0 < p.ratio < 2.2
    long = r.decode_step("h100", cfg, 64, 32768)
    assert long.ratio > p.ratio


def test_paged_engine_step_adds_its_own_measured_launches():
    """The paged engine's step runs the same kernels per layer; what differs is each program's
    measured count of other launches (its loop's page bookkeeping, per step, FP8 and BF16
    alike), charged at ``LAUNCH_S`` each."""
    from kernels_pallas.perf_model import gpu_rollout as r
    from kernels_pallas.perf_model import hlo_launches

    cfg = r.QWEN3_8B
    st, pg = r.decode_step("h100", cfg, 64, 4096), r.decode_step("h100", cfg, 64, 4096, "paged")
    assert (st.engine, pg.engine) == ("static", "paged")
    for prec, s_parts, p_parts in (("fp8", st.fp8_parts, pg.fp8_parts),
                                   ("bf16", st.bf16_parts, pg.bf16_parts)):  # fmt: skip
        ns, np_ = (hlo_launches.load(engine=e)[prec]["64"] for e in ("static", "paged"))
        extra = (np_.total(36) - ns.total(36)) * gpu.LAUNCH_S
        extra += (np_.host_syncs - ns.host_syncs) * gpu.HOST_SYNC_S
        assert sum(p_parts.values()) - sum(s_parts.values()) == pytest.approx(extra)
    # its loop's predicate, the bookkeeping cond's and the decode cond's branch indices, and
    # the grow loop's predicate: read inside the bookkeeping branch, so not in a decode step
    assert hlo_launches.load(engine="paged")["fp8"]["64"].host_syncs == 3
    preds = r.predictions(("h100",))
    assert {p.engine for p in preds} == {"static", "paged"}
    assert "paged engine" in r.target(preds)


def test_targets_judge_the_gemms_the_rollout_runs():
    """The FP8 rollout runs q|k|v and gate|up fused: their separate rows leave the rollout's
    verdicts (kept in the 'every listed shape' lines); the fused change's 'before' is the parts'
    GEMMs summed, each with its own activation quantization."""
    from kernels_pallas.perf_model import gpu_targets as t

    assert not t._runs_alone("Qwen3-8B k|v_proj M=16")
    assert not t._runs_alone("Llama-3-70B gate|up M=64")
    assert t._runs_alone("Qwen3-8B q|k|v fused M=16") and t._runs_alone("Qwen3-8B q|o_proj M=16")
    before = t.separate_sum("h100", 16, (4096, 1024, 1024), 4096, "x")
    parts = [gpu.predict_matmul("h100", 16, n, 4096, "bf16") for n in (4096, 1024, 1024)]
    assert before.time_s == pytest.approx(sum(p.time_s for p in parts))
    assert before.baseline_s == pytest.approx(sum(p.baseline_s for p in parts))
    fused = gpu.predict_matmul("h100", 16, 6144, 4096, "bf16")
    assert fused.time_s < before.time_s  # one launch, one quantization, 96 CTAs


@pytest.mark.parametrize("x", ["bf16", "fp8"])
@pytest.mark.parametrize("in_program", [False, True])
@pytest.mark.parametrize("m,n", [(16, 4096), (64, 4096), (16, 1024)])
def test_hbm_ceiling_bounds_every_tile_and_is_its_bytes_plus_the_fixed_cost(m, n, x, in_program):
    """``hbm_ceiling``: BF16 / (calibration x (FP8 bytes at HBM_EFF + FILL_S) + launch), by hand
    for Qwen3-8B's decode GEMMs; no tile the dispatch ranks, fused or quantized once, is
    predicted past it."""
    from kernels_pallas.fp8_matmul import tile_choice

    k, chip = 4096, "h100"
    p = gpu.predict_matmul(chip, m, n, k, x, in_program=in_program)
    fused = x == "bf16" and "fused" in p.impl
    nbytes = m * k * (2 if fused else 1) + n * k + m * n * 2 + (n // 128) * (k // 128) * 4 + (
        0 if fused else m * (k // 128) * 4)  # fmt: skip
    hbm_s = nbytes / (common.CHIPS[chip].hbm_bytes_per_s * gpu.HBM_EFF) + gpu.FILL_S
    launch = gpu.PDL_LAUNCH_S if " pdl" in p.impl else gpu.LAUNCH_S
    by_hand = p.baseline_s / (gpu.KERNEL_CALIBRATION["mm_decode"] * hbm_s + launch)
    ceiling = gpu.hbm_ceiling(p)
    assert ceiling == pytest.approx(by_hand, rel=1e-9)
    for raw in (True, False) if x == "bf16" else (False,):
        for _, cfg in tile_choice.ranked(m, n, k, fused=raw, chip=chip):
            q = gpu.predict_matmul(chip, m, n, k, x, mode="fused" if raw else "qarray",
                                   config=cfg, in_program=in_program)  # fmt: skip
            assert q.ratio <= ceiling, tile_choice.name(cfg)


def test_compare_predicts_the_decode_attention_rows():
    """bench_decode rows of the Hopper kernel with every slot live get the model's time for
    their arm (swap-AB, ``:unswapped``, ``:bs128``, which the 128-slot profile models,
    ``:st3`` / ``:st5``) at their ring depth: recorded (``num_stages``), or for the first run's
    rows the defaults of then (3 stages on FP8), and their launch (``pdl``: the first run's
    rows launched plainly); ragged rows and the XLA reference get none."""
    from kernels_pallas.perf_model import compare

    row = dict(model="Qwen3-8B", b=32, s=8192, h=32, k=8, c=128, cache="fp8_static",
               lengths="full", impl="pallas_mosaic_gpu")  # fmt: skip
    want = gpu_attention.predict_attention("h200", "decode_attention", 32, 8192, 32, 8, 128, "fp8",
                                 stages=3, pdl=False)  # fmt: skip
    assert compare.predicted_us("h200", row) == pytest.approx(want.time_s * 1e6)
    assert compare.predicted_us("h200", dict(row, impl="pallas_mosaic_gpu:st3")) == \
        pytest.approx(want.time_s * 1e6)  # fmt: skip
    now = gpu_attention.predict_attention("h200", "decode_attention", 32, 8192, 32, 8, 128, "fp8")
    assert compare.predicted_us("h200", dict(row, num_stages=5, pdl=True)) == \
        pytest.approx(now.time_s * 1e6)  # fmt: skip
    assert compare.predicted_us("h200", dict(row, num_stages=5)) == \
        pytest.approx((now.time_s + gpu.LAUNCH_S - gpu.PDL_LAUNCH_S) * 1e6)  # fmt: skip
    assert now.time_s < 0.8 * want.time_s  # the 5-stage default: past the 3-stage latency bound
    un = compare.predicted_us("h200", dict(row, impl="pallas_mosaic_gpu:unswapped"))
    assert un >= compare.predicted_us("h200", row)
    wide = gpu_attention.predict_attention("h200", "decode_attention", 32, 8192, 32, 8, 128, "fp8",
                                 block_s=128, stages=3, pdl=False)  # fmt: skip
    assert wide.impl == "decode_fp8_bs128 J=1 3 stages" and wide.terms["registers"] > 128
    assert wide.terms["ctas_per_sm_max"] == 1  # 200 registers x 256 threads: one CTA per SM
    got = compare.predicted_us("h200", dict(row, impl="pallas_mosaic_gpu:bs128"))
    assert got == pytest.approx(wide.time_s * 1e6)
    deep = gpu_attention.predict_attention("h200", "decode_attention", 32, 8192, 32, 8, 128, "fp8",
                                 stages=5, pdl=False)  # fmt: skip
    got = compare.predicted_us("h200", dict(row, impl="pallas_mosaic_gpu:st5"))
    assert got == pytest.approx(deep.time_s * 1e6) and deep.terms["ctas_per_sm"] == 2
    bf16 = compare.predicted_us("h200", dict(row, cache="bf16"))
    assert bf16 > compare.predicted_us("h200", row)  # twice the bytes
    assert compare.predicted_us("h200", dict(row, lengths="ragged")) is None
    assert compare.predicted_us("h200", dict(row, impl="xla")) is None


def test_swap_ab_up_to_128_rows_is_never_predicted_slower():
    """65-256-row decode batches: where ``swap_default`` takes the swap-AB tile, the model
    predicts it no slower than the prefill tile it replaces, on H100 and H200, standalone and in
    a program, and Qwen3-8B o_proj / down_proj at M = 128 in a program gain >= 1.15x (K split
    over the SMs that a 32-CTA prefill grid leaves idle; calibrated: the swap-AB tiles took
    1.74x their modelled time on the H200, the prefill tiles 1.42x; the SASS model alone says
    1.29x / 1.54x)."""
    rows = [(b, a) for change, b, a in gpu_targets.design_changes()
            if change.startswith("decode GEMM: swap-AB up to 128")]  # fmt: skip
    assert len(rows) >= 16
    for before, after in rows:
        assert "mm_swap_" in after.impl and "mm_qarray_" in before.impl
        assert after.time_s <= before.time_s * 1.001, (after.label, after.chip)
    gains = {(a.label, a.chip): b.time_s / a.time_s for b, a in rows}
    for label in ("Qwen3-8B q|o_proj M=128, in program", "Qwen3-8B down M=128, in program"):
        assert gains[(label, "h100")] >= 1.15 and gains[(label, "h200")] >= 1.15, label


def test_promotions_under_the_wgmmas_are_never_predicted_slower():
    """Where the prefill default promotes under its wgmmas (``MgpuConfig.overlap``), the model
    predicts it faster than the tiles it replaced at every listed shape, H100 and H200 (two
    compute warpgroups in step no longer leave the tensor core idle through each wait and
    promotion), by >= 1.05x at M = 4096; its profile shows the promotion issuing under the
    MMAs (most of the loop, where the plain 128x128 loop has a fifth)."""
    rows = [(b, a) for change, b, a in gpu_targets.design_changes()
            if change.startswith("prefill: promotions under the wgmmas")]  # fmt: skip
    assert len(rows) >= 16
    for before, after in rows:
        assert "_o " in after.impl and "_o " not in before.impl, after.impl
        assert after.time_s < before.time_s, (after.label, after.chip)
        if "M=4096" in after.label:
            assert before.time_s / after.time_s >= 1.05, (after.label, after.chip)
    profs = gpu.load_profiles()
    o, plain = (profs[n]["main_loop"] for n in ("mm_qarray_128x128_c2_o", "mm_qarray_128x128_c2"))
    assert o["under_mma"] > 0.7 * o["total"] and plain["under_mma"] < 0.25 * plain["total"]


def test_nearest_profile_takes_the_next_row_tile_up_and_its_split():
    """An unprofiled tile takes the profile of the same family and column tile with the
    nearest row tile at or above it (else the widest), with its split-K suffix if profiled,
    else the unsplit one; an unprofiled column tile, the next wider one's; a name without a
    tile takes its family's last."""
    names = ("mm_swap_16x64", "mm_swap_64x64", "mm_swap_64x64_k2", "mm_swap_128x128",
             "decode_fp8", "decode_fp8_unswapped")  # fmt: skip
    p = {n: {"name": n} for n in names}
    pick = lambda name: sass_profiles.nearest_profile(name, p)["name"]
    assert pick("mm_swap_64x64_k2 split_k=2") == "mm_swap_64x64_k2"  # exact (label suffix cut)
    assert pick("mm_swap_48x64_k2") == "mm_swap_64x64_k2"  # next row tile up, same split
    assert pick("mm_swap_32x64_k4") == "mm_swap_64x64"  # no k4 at 64 rows: unsplit
    assert pick("mm_swap_96x64") == "mm_swap_64x64"  # none above: the widest
    assert pick("mm_swap_80x128_k8") == "mm_swap_128x128"  # column tile 128 only at 128 rows
    assert pick("decode_fp8_x") == "decode_fp8_unswapped"
    # no 32-column profile: the next wider column tile (a 64x32 tile found no profile on the
    # first device run's DeepSeek-V3 N = 2112 row, 128x64 in 2-CTA clusters)
    assert pick("mm_swap_64x32_k2") == "mm_swap_64x64_k2"
    with pytest.raises(KeyError, match="no SASS profile"):
        pick("mm_fused_64x64")
    # several 128-K slices a step (``_s2``): only a loop of as many slices stands in
    p |= {n: {"name": n} for n in ("mm_swap_64x64_s2", "mm_swap_16x64_k2c_s2")}
    assert pick("mm_swap_48x64_k2_s2") == "mm_swap_64x64_s2"  # up, unsplit (same loop)
    assert pick("mm_swap_16x64_k2c_s2") == "mm_swap_16x64_k2c_s2"
    assert pick("mm_swap_96x64_s2") == "mm_swap_64x64_s2"  # none above: the widest with it
    with pytest.raises(KeyError, match="no SASS profile"):
        pick("mm_swap_64x128_s2")  # its one-slice profile would undercount the loop


def test_in_cluster_split_k_pays_the_sm_network_not_the_sum():
    """Two K chunks summed in their cluster (``cluster_k``): per wave, one SM-to-SM latency pair
    and the one 64 x 32 f32 accumulator (8 KiB: 16 rows run in the smallest swap tile, 32) each
    summing CTA receives at its 1/132 share of the network; with XLA summing them instead, the
    3 x N x 32 f32 partial bytes and the sum's launch (standalone). Same K loop either way (its
    SASS profile)."""
    import dataclasses

    from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu

    cfg = mgpu.default_config(16, 4096, 4096)
    assert cfg.split_k == 2 and cfg.cluster_k
    ours = gpu.predict_matmul("h100", 16, 4096, 4096, "fp8", config=cfg)
    xla = gpu.predict_matmul("h100", 16, 4096, 4096, "fp8",
                             config=dataclasses.replace(cfg, cluster_k=False))  # fmt: skip
    per_sm = gpu.DSMEM_BYTES_PER_S / 132
    assert ours.terms["extra_s"] == pytest.approx(
        ours.terms["waves"] * (gpu.DSMEM_LATENCY_S + 64 * 32 * 4 / per_sm)
    )
    assert xla.terms["extra_s"] == pytest.approx(3 * 4096 * 32 * 4 / 3.35e12 + gpu.LAUNCH_S,
                                                 rel=0.01)  # fmt: skip
    assert ours.terms["compute_s"] == pytest.approx(xla.terms["compute_s"])
    assert ours.time_s < xla.time_s
