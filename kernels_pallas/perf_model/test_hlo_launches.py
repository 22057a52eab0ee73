"""Counting a decode loop's launches in compiled HLO text (``hlo_launches``)."""
# ruff: noqa: E501  (the HLO fixture keeps compiled-HLO line shapes)

import pytest

from kernels_pallas.perf_model import hlo_launches as h

# A compiled-HLO-shaped program: prefill's chunk loop (known trip count), then the decode loop
# whose body holds a norm fusion, a Triton and a Mosaic kernel, an XLA GEMM fusion, a copy and a
# conditional with one fusion per branch (counted both: an upper bound) and a nested call.
HLO = """HloModule jit_rollout

%fused_norm (p: bf16[16,4096]) -> bf16[16,4096] {
  ROOT %m = bf16[16,4096]{1,0} multiply(%p, %p)
}

%branch_a (t: (s32[])) -> (s32[]) {
  %f = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%branch_b (t: (s32[])) -> (s32[]) {
  %g = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%inner (t: (s32[])) -> (s32[]) {
  %k = f32[8] custom-call(%a), custom_call_target="mosaic_gpu_v2"
}

%prefill_body (t: (s32[])) -> (s32[]) {
  %c = f32[8] custom-call(%a), custom_call_target="mosaic_gpu_v2"
}

%decode_body (t: (s32[])) -> (s32[]) {
  %n = bf16[16,4096]{1,0} fusion(%a), kind=kCustom, calls=%fused_norm
  %q = (f8e4m3fn[16,4096]{1,0}, f32[32,16]{1,0}) custom-call(%n), custom_call_target="__gpu$xla.gpu.triton"
  %mm = bf16[6144,16]{1,0} custom-call(%q), custom_call_target="mosaic_gpu_v2"
  %d = bf16[16,151936]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.1.gemm_fusion_dot_computation
  %cp = bf16[16]{0} copy(%a)
  %br = (s32[]) conditional(%p, %t, %t), branch_computations={%branch_a, %branch_b}
  %cl = (s32[]) call(%t), to_apply=%inner
  %bt = bf16[16]{0} bitcast(%a)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w1 = (s32[]) while(%t), condition=%c1, body=%prefill_body, metadata={op_name="jit(rollout)/jit(_generate)/while"}, backend_config={"known_trip_count":{"n":"8"}}
  %w2 = (s32[]) while(%t), condition=%c2, body=%decode_body, metadata={op_name="jit(rollout)/jit(_generate)/while"}
}
"""


def test_counts_the_decode_loop_by_kind():
    got = h.decode_body_launches(HLO)
    assert dict(got) == {"xla": 4, "triton": 1, "mosaic": 2, "xla_gemm": 1}


def test_per_layer_and_per_step_from_one_and_two_layers():
    one = {"mosaic": 5, "triton": 4, "xla_gemm": 1, "xla": 34}
    two = {"mosaic": 10, "triton": 8, "xla_gemm": 1, "xla": 51}
    n = h.split_layers(h.collections.Counter(one), h.collections.Counter(two))
    assert n.per_layer == {"mosaic": 5, "triton": 4, "xla_gemm": 0, "xla": 17}
    assert n.per_step == {"mosaic": 0, "triton": 0, "xla_gemm": 1, "xla": 17}
    assert n.total(36) == 36 * 26 + 18
    with pytest.raises(ValueError, match="2 layers launch less"):
        h.split_layers(h.collections.Counter(two), h.collections.Counter(one))


def test_one_decode_loop_or_an_error():
    with pytest.raises(ValueError, match="found 0"):
        h.decode_body_launches(HLO.replace("_generate", "_other"))


def test_committed_measurement_covers_the_rollout_batches():
    """The committed counts (``python -m kernels_pallas.perf_model.hlo_launches``) have both
    programs at every batch the rollout table shows."""
    from kernels_pallas.perf_model import gpu_rollout

    data = h.load()
    for prec in ("fp8", "bf16"):
        assert {str(b) for b in gpu_rollout.BATCHES} <= set(data[prec])
