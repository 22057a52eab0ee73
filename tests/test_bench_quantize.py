"""experiments/bench_quantize.py: both arms per op on the same operands, the kernel's codes
against XLA's, and the speedup over XLA."""

import json

import pytest

from experiments import bench_quantize as bq


def test_quick_run_times_xla_and_the_kernels_on_the_same_operands(tmp_path):
    out = tmp_path / "bench_quantize.json"
    bq.main(["--quick", "--ms", "16", "--runs", "1", f"--out={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["impl"]) for r in rows] == [
        (op, impl) for op, _ in bq.CPU_OPS for impl in ("xla", "pallas_triton")
    ]
    assert all("error" not in r for r in rows), rows
    by = {(r["op"], r["impl"]): r for r in rows}
    # the standalone kernel equals XLA's quantize_activations bit for bit
    assert by[("quantize", "pallas_triton")]["codes_equal_xla"] == 1.0
    # the producers: XLA keeps f32 between the fused producer ops (excess precision) where the
    # kernels round to the activations' dtype as the unfused ops do: a few codes move
    for op in ("rmsnorm+quantize", "swiglu+quantize"):
        assert by[(op, "pallas_triton")]["codes_equal_xla"] > 0.9
    for op, _ in bq.CPU_OPS:
        x, k = by[(op, "xla")], by[(op, "pallas_triton")]
        assert k["speedup_vs_xla"] == pytest.approx(x["median_us"] / k["median_us"])
        assert x["codes_equal_xla"] == 1.0


def test_kernel_bytes_by_hand():
    """[16, 256]: 8 KiB of BF16 x, 4 KiB of codes, 16 x 2 f32 scales; SwiGLU reads gate and up."""
    assert bq.kernel_bytes("quantize", 16, 256) == 8192 + 4096 + 128
    assert bq.kernel_bytes("swiglu+quantize", 16, 256) == 2 * 8192 + 4096 + 128
