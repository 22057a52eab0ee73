"""The MoE rollout step model (``gpu_rollout_moe``): its parts are the kernels' predictions times
the layers, its launch counts the compiled programs' (committed), and the grouped kernels in a
program leave out only the launches the count already has."""

import pytest

from kernels_pallas.perf_model import gpu, gpu_grouped, gpu_rollout_moe, hlo_launches


def test_in_a_program_the_grouped_kernels_leave_out_only_their_fusions_launches():
    for rows in (128, 512, 2048):
        args = ("h100", rows, 128, 2048, (768, 768))
        alone, inside = (gpu_grouped.predict_grouped_fp8(*args, in_program=p) for p in (0, 1))
        assert alone.time_s - inside.time_s == pytest.approx(3 * gpu.LAUNCH_S, rel=1e-9)
        bargs = ("h100", rows, rows, 128, 2048, 768, "fwd")
        alone, inside = (gpu_grouped.predict_grouped_bf16(*bargs, in_program=p) for p in (0, 1))
        # the tile map's (rows are whole row tiles: no pad; rows stored into y: no gather)
        assert alone.time_s - inside.time_s == pytest.approx(gpu.LAUNCH_S, rel=1e-9)


def test_moe_step_is_its_kernels_and_its_programs_counts():
    """Qwen3-30B-A3B, B = 64 (512 expert rows) on the H100: each part is its kernel's prediction
    x 48 layers, the other fusions the count x ``LAUNCH_S``, and the step their sum."""
    cfg, b = gpu_rollout_moe.QWEN3_30B_A3B, 64
    p = gpu_rollout_moe.moe_step("h100", cfg, b, 4096)
    counts = hlo_launches.load(hlo_launches.launches_json("qwen3-30b-a3b"), engine="static")
    fp8_n, bf16_n = counts["fp8"]["64"], counts["bf16"]["64"]
    assert (fp8_n.per_layer["mosaic"], fp8_n.per_layer["triton"]) == (5, 2)
    assert (bf16_n.per_layer["mosaic"], bf16_n.per_layer["xla_gemm"]) == (4, 3)
    up = gpu_grouped.predict_grouped_fp8("h100", 512, 128, 2048, (768, 768), in_program=True)
    assert p.fp8_parts["experts gate+up (grouped FP8, one launch)"] == pytest.approx(48 * up.time_s)
    gmm = [gpu_grouped.predict_grouped_bf16("h100", 512, 512, 128, k, n, "fwd", in_program=True)
           for k, n in ((2048, 768), (768, 2048))]  # fmt: skip
    bf16_up = p.bf16_parts["experts gate, up (grouped BF16 kernel, two launches)"]
    assert bf16_up == pytest.approx(48 * 2 * gmm[0].time_s)
    xla = fp8_n.per_layer["xla"]
    assert p.fp8_parts[f"{xla} other fusions"] == pytest.approx(48 * xla * gpu.LAUNCH_S)
    assert p.fp8_s == pytest.approx(sum(p.fp8_parts.values()))
    assert p.bf16_s == pytest.approx(sum(p.bf16_parts.values()))
    # the cache: 48 layers x 64 rows x 6,144 slots x 2 x 4 KV heads x 128, one byte (FP8)
    assert p.kv_fp8_gib == pytest.approx(48 * 64 * 6144 * 2 * 512 / 2**30)


def test_every_engine_batch_and_chip_is_predicted_from_its_own_count():
    preds = gpu_rollout_moe.predictions()
    assert [(p.engine, p.chip, p.batch) for p in preds] == [
        (e, c, b) for e in hlo_launches.ENGINES for c in gpu.GPU_CHIPS
        for b in gpu_rollout_moe.BATCHES
    ]  # fmt: skip
    for p in preds:  # FP8 experts stream half the bytes in one launch fewer per layer
        fp8 = sum(v for k, v in p.fp8_parts.items() if k.startswith("experts"))
        bf16 = sum(v for k, v in p.bf16_parts.items() if k.startswith("experts"))
        assert fp8 < bf16, (p.chip, p.batch)
