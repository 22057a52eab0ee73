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

%c1 (t: (s32[])) -> pred[] {
  ROOT %lt = pred[] compare(%x, %y), direction=LT
}

%c2 (t: (s32[])) -> pred[] {
  %any = pred[] fusion(%x), kind=kInput, calls=%fused_norm
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
    # the body's norm, copy, one fusion per branch (both: an upper bound), the condition's fusion
    assert dict(got) == {"xla": 5, "triton": 1, "mosaic": 2, "xla_gemm": 1}


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


# The paged engine's loop (``run_engine``): its body's own fusions (page bookkeeping), the
# admission branch (prefill: a Mosaic GEMM, no paged attention), the page-growing loop, and the
# decode branch (the paged attention kernel, a GEMM, a fusion; its other branch empty).
PAGED_HLO = """HloModule jit_rollout

%fused_norm (p: bf16[16,4096]) -> bf16[16,4096] {
  ROOT %m = bf16[16,4096]{1,0} multiply(%p, %p)
}

%admit (t: (s32[])) -> (s32[]) {
  %pf = f32[8] custom-call(%a), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(rollout)/jit(run_engine)/while/body/cond/branch_1_fun/jit(_run)/jit(fp8_matmul_mgpu)"}
  %s = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%grow_body (t: (s32[])) -> (s32[]) {
  %g = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%decode (t: (s32[])) -> (s32[]) {
  %at = f32[8] custom-call(%a), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(rollout)/jit(run_engine)/while/body/cond/branch_1_fun/jit(paged_attention_mgpu)/anonymous"}
  %mm = f32[8] custom-call(%a), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(rollout)/jit(run_engine)/while/body/cond/branch_1_fun/jit(_run)/jit(fp8_matmul_mgpu)"}
  %r = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%empty (t: (s32[])) -> (s32[]) {
  ROOT %t = (s32[]) tuple(%x)
}

%c1 (t: (s32[])) -> pred[] {
  %more = pred[] fusion(%x), kind=kInput, calls=%fused_norm
}

%c3 (t: (s32[])) -> pred[] {
  %short = pred[] fusion(%x), kind=kInput, calls=%fused_norm
}

%engine_body (t: (s32[])) -> (s32[]) {
  %rel = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
  %ad = (s32[]) conditional(%p, %t, %t), true_computation=%admit, false_computation=%empty
  %gw = (s32[]) while(%t), condition=%c3, body=%grow_body, metadata={op_name="jit(rollout)/jit(run_engine)/while/body/while"}
  %dc = (s32[]) conditional(%q, %t, %t), true_computation=%decode, false_computation=%empty
  %cp = s32[] copy(%x)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[]) while(%t), condition=%c1, body=%engine_body, metadata={op_name="jit(rollout)/jit(run_engine)/while"}
}
"""


def test_paged_step_counts_the_loop_and_its_decode_branch_only():
    got = h.paged_step_launches(PAGED_HLO)
    # release fusion + copy (the body), attention + GEMM + fusion (decode), the loop's and the
    # growing loop's conditions; not the admission branch's prefill nor the growing loop's body
    assert dict(got) == {"xla": 5, "mosaic": 2}
    with pytest.raises(ValueError, match="one decode branch"):
        h.paged_step_launches(PAGED_HLO.replace("paged_attention_mgpu", "other_mgpu"))
    with pytest.raises(ValueError, match="one paged engine loop, found 0"):
        h.paged_step_launches(PAGED_HLO.replace("run_engine", "other"))


def test_host_syncs_are_the_predicates_a_step_reads():
    """One per data-dependent loop predicate and per conditional's branch index; a known trip
    count's body as many times as it runs; in the paged step the decode branch's own, not the
    admission branch's, and the growing loop's predicate once."""
    assert h.decode_body_syncs(HLO) == 2  # the decode loop's predicate + the body's conditional
    assert h.paged_step_syncs(PAGED_HLO) == 4  # loop + admission cond + grow loop + decode cond
    nested = PAGED_HLO.replace(
        "  %r = s32[] fusion(%x), kind=kLoop, calls=%fused_norm\n}",
        "  %r = s32[] fusion(%x), kind=kLoop, calls=%fused_norm\n"
        "  %k = (s32[]) conditional(%p, %t, %t), true_computation=%empty, false_computation=%empty\n}",
    )
    assert h.paged_step_syncs(nested) == 5  # a cond inside the decode branch: one more
    admit_cond = PAGED_HLO.replace(
        "  %s = s32[] fusion(%x), kind=kLoop, calls=%fused_norm\n}",
        "  %s = s32[] fusion(%x), kind=kLoop, calls=%fused_norm\n"
        "  %k = (s32[]) conditional(%p, %t, %t), true_computation=%empty, false_computation=%empty\n}",
    )
    assert h.paged_step_syncs(admit_cond) == 4  # inside the skipped admission branch: none
    comps = h.computations(HLO)
    comps["outer"] = [
        '  %w = (s32[]) while(%t), condition=%c1, body=%decode_body, backend_config={"known_trip_count":{"n":"3"}}'
    ]
    assert h.syncs(comps, "outer") == 3  # the body's conditional, three times; no predicate
    with pytest.raises(ValueError, match="host syncs per step differ"):
        h.split_layers(h.decode_body_launches(HLO), h.decode_body_launches(HLO), (1, 2))


def test_conditional_branches_in_both_forms():
    line_pair = "%c = (s32[]) conditional(%p, %t, %t), true_computation=%yes, false_computation=%no"
    line_list = "%c = (s32[]) conditional(%i, %t, %t), branch_computations={%b0, %b1, %b2}"
    assert h.branches(line_pair) == ["yes", "no"]
    assert h.branches(line_list) == ["b0", "b1", "b2"]


def test_committed_measurement_covers_the_rollout_batches():
    """The committed counts (``python -m kernels_pallas.perf_model.hlo_launches``) have both
    programs of both engines at every batch the rollout table shows, with the kernels the
    rollout model charges one by one (5 Mosaic + 4 Triton per FP8 layer, none at 16 rows,
    whose GEMMs take raw x: ``act_quantize.quantizes_for``; 5 XLA GEMMs + the attention kernel
    per BF16 layer)."""
    from kernels_pallas.perf_model import gpu_rollout

    for engine in h.ENGINES:
        data = h.load(engine=engine)
        for prec in ("fp8", "bf16"):
            assert {str(b) for b in gpu_rollout.BATCHES} <= set(data[prec])
        for b, n in data["fp8"].items():
            triton = 0 if b == "16" else 4
            assert (n.per_layer["mosaic"], n.per_layer["triton"]) == (5, triton), b
        for n in data["bf16"].values():
            assert (n.per_layer["xla_gemm"], n.per_layer["mosaic"]) == (5, 1)
    with pytest.raises(ValueError, match="engine must be one of"):
        h.load(engine="dense")


def test_a_loop_with_a_known_trip_count_launches_its_body_every_iteration():
    """A ``while`` XLA knows the trips of (``jnp.searchsorted``'s binary search: log2(E) + 1)
    launches its body n times and its condition n + 1 times; without a known count, once
    each (a loop of its own)."""
    known = '{"known_trip_count":{"n":"8"}}'
    body = """%search_body (t: (s32[])) -> (s32[]) {
  %f1 = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
  %f2 = s32[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%search_cond (t: (s32[])) -> pred[] {
  %c = pred[] fusion(%x), kind=kLoop, calls=%fused_norm
}

%outer (t: (s32[])) -> (s32[]) {
  %w = (s32[]) while(%t), condition=%search_cond, body=%search_body, backend_config=BC
}
"""
    comps = h.computations(body.replace("BC", known))
    assert h.trip_count(comps["outer"][0]) == 8
    assert h.launches(comps, "outer") == {"xla": 8 * 2 + 9 * 1}
    comps = h.computations(body.replace("BC", "{}"))
    assert h.trip_count(comps["outer"][0]) is None
    assert h.launches(comps, "outer") == {"xla": 2 + 1}
