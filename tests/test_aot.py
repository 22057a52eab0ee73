"""The AOT check's pure parts, in the main venv (no CUDA/TPU plugin, nothing compiled).

ptxas and Mosaic dump parsing, kernel counting, status rules, the HBM-bytes counter of
``experiments/hlo_bytes.py`` on a hand-written HLO module, and that every ``aot_cases.py``
yields well-formed cases. The compiles themselves run in ``scripts/aot_check.py`` (CI).
"""

import importlib.util
import os
import types

import jax
import pytest

from experiments import hlo_bytes
from kernels_pallas import aot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_aot_check():
    spec = importlib.util.spec_from_file_location(
        "aot_check", os.path.join(REPO, "scripts", "aot_check.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ptxas -v output of two kernels, as Mosaic GPU dumps it (<kernel>.ptxas): one clean, one spilling.
PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'body_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for body_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 135 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 32.554 ms
ptxas info    : Compiling entry function 'decode_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for decode_mosaic_gpu_kernel
    88 bytes stack frame, 88 bytes spill stores, 92 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 101.2 ms
"""
RESOURCES = (
    "Resources(smem_scratch_bytes=131072, tmem_scratch_cols=0, tmem_collective_scratch_cols=0, "
    "barrier_counts=Counter({Barrier(arrival_count=1, num_barriers=1): 1}))\n"
)


def test_parse_ptxas_registers_spills_smem():
    clean, spilling = aot.parse_ptxas(PTXAS, dynamic_smem_bytes=4096)
    assert clean == aot.KernelReport("body_mosaic_gpu_kernel", 135, 0, 0, 1, 4096)
    assert clean.smem_bytes == 4097
    assert (spilling.name, spilling.registers) == ("decode_mosaic_gpu_kernel", 255)
    assert (spilling.spill_stores, spilling.spill_loads, spilling.static_smem_bytes) == (88, 92, 0)
    result = aot.CompileResult("h100", None, [clean, spilling], num_pallas_kernels=2)
    assert (result.max_registers, result.spills, result.max_smem_bytes) == (255, 180, 4097)


def test_read_dumps_pairs_ptxas_with_resources(tmp_path):
    first_kernel = PTXAS.split("ptxas info    : Compiling entry function 'decode")[0]
    (tmp_path / "body_0.ptxas").write_text(first_kernel)
    (tmp_path / "body_0.resources.txt").write_text(RESOURCES)
    (tmp_path / "body_0.ptx").write_text("// not a report")
    (report,) = aot.read_dumps(str(tmp_path))
    assert (report.registers, report.dynamic_smem_bytes, report.smem_bytes) == (135, 131072, 131073)
    assert aot.parse_resources("no such field") == 0


def test_read_dumps_pairs_by_order_and_reuses_reports_of_cached_kernels(tmp_path):
    # Mosaic GPU numbers MLIR dumps and PTX dumps with separate counters, and a kernel compiled
    # before in the process yields MLIR dumps but no ptxas: compile 1 lowers kernels A and B
    # (both new), compile 2 lowers A again (cached) and C (new; its ptxas is numbered 2).
    first, second = PTXAS.split("ptxas info    : Compiling entry function 'decode")
    second = "ptxas info    : Compiling entry function 'decode" + second
    res = RESOURCES.replace("131072", "@")

    def lowered(d, i, body, smem):
        (d / f"k_{i}.before_layout_inference.txt").write_text(f"module @k_{i} {{ {body} }}")
        (d / f"k_{i}.resources.txt").write_text(res.replace("@", str(smem)))

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    lowered(one, 0, "kernel A", 1024)
    lowered(one, 1, "kernel B", 2048)
    (one / "k_0.ptxas").write_text(first)
    (one / "k_1.ptxas").write_text(second)
    a, b = aot.read_dumps(str(one))
    assert (a.registers, a.dynamic_smem_bytes, b.registers, b.dynamic_smem_bytes) == (
        135, 1024, 255, 2048,
    )  # fmt: skip
    lowered(two, 2, "kernel A", 1024)
    lowered(two, 3, "kernel C", 4096)
    (two / "k_2.ptxas").write_text(second)  # C's ptxas carries the PTX counter, 2
    a2, c = aot.read_dumps(str(two))
    assert a2 == a  # the cached kernel: its first compile's report
    assert (c.registers, c.dynamic_smem_bytes) == (255, 4096)


def test_count_kernels_in_hlo_and_stablehlo():
    hlo = (
        '%a = f32[8]{0} custom-call(%x), custom_call_target="mosaic_gpu_v2", api_version=4\n'
        '%b = f32[8]{0} custom-call(%a), custom_call_target="__cublas$gemm"\n'
    )
    assert aot.count_kernels(hlo, "h100") == 1
    assert aot.count_kernels(hlo, "v5e") == 0
    mlir = '%0 = stablehlo.custom_call @tpu_custom_call(%arg0) {backend_config = "..."}'
    assert aot.count_kernels(mlir, "v6e") == 1
    assert aot.count_kernels(mlir.replace("tpu_custom_call", "mosaic_gpu_v2"), "h100") == 1


def test_one_line_and_status_rules():
    err = ValueError("\nMosaic GPU kernel exceeds available shared memory: smem_bytes=249920 > 1\n"
                     "  more detail\n")  # fmt: skip
    assert aot.one_line(err) == (
        "ValueError: Mosaic GPU kernel exceeds available shared memory: smem_bytes=249920 > 1"
    )
    assert len(aot.one_line(ValueError("x" * 1000))) == 400
    where = ValueError("Block spec in pallas_call _kernel at /a/b/kernels_pallas/op/tpu.py:43 has")
    assert (
        aot.one_line(where) == "ValueError: Block spec in pallas_call _kernel at op/tpu.py:43 has"
    )
    case = aot.AotCase("op", "pallas_mosaic_gpu", "h100", "label", None, ())
    xla_case = aot.AotCase("op", "xla", "h100", "label", None, ())
    ok = aot.KernelReport("k", 100, 0, 0, 0, 1024)
    spill = aot.KernelReport("k", 255, 8, 8, 0, 1024)
    assert aot.status_of(case, None, err) == "smem"
    assert aot.status_of(case, None, NotImplementedError("f8 to bf16")) == "fail"
    assert aot.status_of(case, aot.CompileResult("h100", None, [ok], 1), None) == "ok"
    assert aot.status_of(case, aot.CompileResult("h100", None, [spill], 1), None) == "spill"
    assert aot.status_of(case, aot.CompileResult("h100", None, [], 0), None) == "no-kernel"
    assert aot.status_of(xla_case, aot.CompileResult("h100", None, [], 0), None) == "ok"
    compiled = types.SimpleNamespace(as_text=lambda: "")  # a compile, not the quick export
    unseen = aot.CompileResult("h100", compiled, [], 1)
    assert aot.status_of(case, unseen, None) == "no-report"  # registers nobody has seen
    assert aot.status_of(case, aot.CompileResult("h100", None, [], 1), None) == "ok"  # export


def test_every_aot_cases_module_yields_well_formed_cases():
    check = _load_aot_check()
    modules = check.case_modules()
    assert {
        "kernels_pallas.fp8_matmul.aot_cases",
        "kernels_pallas.decode_attention.aot_cases",
        "fp8rl_jax.generation.aot_cases",
    } <= set(modules)
    keys = []
    for module in modules:
        cases = check.load_cases(module)
        assert cases, module
        for c in cases:
            assert isinstance(c, aot.AotCase) and c.op and c.label and callable(c.fn)
            assert c.target in aot.TARGETS
            if c.impl == "pallas_mosaic_gpu":
                assert aot.PLATFORM[c.target] == "cuda", c.key
            if c.impl == "pallas_tpu":
                assert aot.PLATFORM[c.target] == "tpu", c.key
            leaves = jax.tree.leaves(c.args)
            assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), c.key
            keys.append(c.key)
    assert len(keys) == len(set(keys)), "case keys must be unique (the workers look cases up)"
    ops = {k.split(" | ")[0] for k in keys}
    assert {"fp8_matmul", "decode_attention", "rollout"} <= ops
    for op, targets in (("fp8_matmul", aot.TARGETS), ("rollout", aot.TARGETS)):
        assert {k.split(" | ")[2] for k in keys if k.startswith(op)} == set(targets)


def test_table_and_summary():
    check = _load_aot_check()
    case = aot.AotCase("fp8_matmul", "pallas_mosaic_gpu", "h100", "M=16", None, ())
    rec_ok = check._record(case, "ok", compile_s=1.5, max_registers=152, spill_bytes=0,
                           smem_bytes=200 * 1024)  # fmt: skip
    rec_bad = check._record(case, "smem", "ValueError: exceeds", compile_s=0.2)
    assert check.summarize([rec_ok, rec_bad, rec_bad]) == {"ok": 1, "smem": 2}
    assert check._smem_cell(rec_ok) == "200K/227K" and check._smem_cell(rec_bad) == "OVER"
    args = check.parse_args(["--quick", "--op", "fp8_matmul", "--target", "v5e"])
    assert args.quick and args.op == ["fp8_matmul"] and args.target == ["v5e"]


def _labels(cases):
    return [(c.op, c.impl, c.target, c.label) for c in cases]


def test_match_and_sample_select_cases():
    check = _load_aot_check()

    def mk(op, impl, target, label):
        return aot.AotCase(op, impl, target, label, None, ())

    cases = [
        mk("fp8_matmul", "pallas_mosaic_gpu", "h100", "M=1"),
        mk("fp8_matmul", "xla", "h100", "M=1"),
        mk("fp8_matmul", "pallas_mosaic_gpu", "h100", "M=16"),
        mk("fp8_matmul", "pallas_mosaic_gpu", "v5e", "M=1"),
        mk("decode_attention", "pallas_mosaic_gpu", "h100", "B=1"),
        mk("fp8_matmul", "pallas_mosaic_gpu", "h100", "M=4096"),
    ]
    assert _labels(check.sample(cases, 1)) == _labels([cases[i] for i in (0, 1, 3, 4)])
    # evenly spaced: the first and the last of (fp8_matmul, pallas_mosaic_gpu, h100), M=1, M=4096
    assert _labels(check.sample(cases, 2)) == _labels([cases[i] for i in (0, 1, 3, 4, 5)])
    assert check.sample(cases, 3) == cases
    assert check.sample(cases, None) == cases
    pallas_h100 = [c for c in cases if check._selected(c, [], ["h100"], ["pallas_mosaic_gpu"])]
    assert _labels(pallas_h100) == _labels([cases[i] for i in (0, 2, 4, 5)])
    assert not check._selected(cases[0], ["decode_attention"], [], [])
    args = check.parse_args(["--sample", "1", "--match", "pallas", "--match", "M=1"])
    assert args.sample == 1 and args.match == ["pallas", "M=1"]


# A decode-loop body by hand: an embedding gather, a matmul, an in-place FP8 cache update, a copy,
# a free bitcast; the entry also has a smaller loop (find_loop must pick the larger body).
with open(os.path.join(REPO, "tests", "fixtures", "hlo", "decode_loop.hlo")) as _f:
    HLO = _f.read()


def test_shape_bytes():
    assert hlo_bytes.shape_bytes("bf16[64,4096]{1,0}") == 64 * 4096 * 2
    assert hlo_bytes.shape_bytes("f8e4m3fn[2,3]{1,0}") == 6
    assert hlo_bytes.shape_bytes("(f32[2]{0}, /*index=1*/pred[], s32[<=8]{0})") == 8 + 1 + 32
    assert hlo_bytes.shape_bytes("s32[]") == 4


def test_loop_bytes_on_hand_written_hlo():
    result = hlo_bytes.loop_iteration_bytes(HLO)
    by_name = {name: b for name, _, b in result.per_instr}
    # The gather reads 4 embedding rows (not the table) and the ids, and writes the rows.
    assert by_name["x"] == 4 * 256 * 2 + 4 * 4 + 4 * 256 * 2
    assert by_name["y"] == 4 * 256 * 2 + 256 * 128 * 2 + 4 * 128 * 2
    # In place: the cache is neither read nor rewritten; y and step are read, 4x128 FP8 written.
    assert by_name["new_cache"] == 4 * 128 * 2 + 4 + 4 * 1 * 128
    assert by_name["ids2"] == 2 * 16
    assert by_name["next"] == 3 * 4
    assert by_name["lt"] == 4 + 4 + 1  # the loop condition runs every iteration too
    assert "t" not in by_name and "y_view" not in by_name and "embed" not in by_name
    assert result.total == sum(by_name.values()) == 74313
    assert result.nested_loops == 0


def test_custom_call_aliasing_and_workspace():
    hlo = HLO.replace(
        "  %ids2 = s32[4]{0} copy(%ids)\n",
        '  %ids2 = s32[4]{0} copy(%ids)\n'
        '  %cc = (bf16[4,128]{1,0}, s8[1024]{0}) custom-call(%x, %w), '
        'custom_call_target="__cublas$gemm"\n'
        '  %k = f8e4m3fn[4,64,128]{2,1,0} custom-call(%cache, %y), '
        'custom_call_target="mosaic_gpu_v2", output_to_operand_aliasing={{}: (0, {})}, '
        'backend_config={kernel_hash = "x"}\n',
    )  # fmt: skip
    by_name = {n: b for n, _, b in hlo_bytes.loop_iteration_bytes(hlo).per_instr}
    assert by_name["cc"] == 4 * 256 * 2 + 256 * 128 * 2 + 4 * 128 * 2  # workspace not counted
    assert by_name["k"] == 4 * 64 * 128 + 4 * 128 * 2  # reads the cache, writes it in place


def test_find_loop_rejects_loopless_module():
    with pytest.raises(ValueError, match="no while loop"):
        hlo_bytes.loop_iteration_bytes(HLO.split("%body (")[0] + "ENTRY %m () -> s32[] {\n"
                                       "  ROOT %c = s32[] constant(0)\n}\n")  # fmt: skip


def _ci_match_strings() -> list[str]:
    """The quoted case names of .ci/run's JAX0112_CASES array (passed as --match)."""
    with open(os.path.join(REPO, ".ci", "run")) as f:
        text = f.read()
    block = text.split("JAX0112_CASES=(", 1)[1].split("\n)", 1)[0]
    return [line.strip().strip('"') for line in block.splitlines() if line.strip()]


def test_ci_match_strings_each_select_a_case():
    # A renamed case (e.g. a new MgpuConfig field in its repr) makes aot_check exit 2 in CI's
    # jax 0.11.2 step, 25 minutes in: catch it here, where listing the cases takes seconds.
    check = _load_aot_check()
    matches = _ci_match_strings()
    assert len(matches) >= 8 and all(m.count(" | ") >= 3 for m in matches), matches
    groups, broken = check.collect([], [], matches, kernels_only=True)
    assert not broken
    keys = [c.key for _, cases in groups for c in cases]
    assert [m for m in matches if not any(m in k for k in keys)] == []
