"""experiments/hlo_flops.py on a hand-written HLO module: dot FLOPs through fusions and loops."""
# ruff: noqa: E501 (HLO lines are as XLA prints them)

from experiments import hlo_flops

HLO = """\
HloModule m

%fused_dot (p0: f32[4,8,16], p1: f32[4,16,32]) -> f32[4,8,32] {
  %p0 = f32[4,8,16]{2,1,0} parameter(0)
  %p1 = f32[4,16,32]{2,1,0} parameter(1)
  ROOT %d = f32[4,8,32]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%body (c: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%c), index=1
  %y = f32[16,16]{1,0} dot(%x, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %x)
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[4,8,16], b: f32[4,16,32], x: f32[8,16]) -> f32[4,8,32] {
  %a = f32[4,8,16]{2,1,0} parameter(0)
  %b = f32[4,16,32]{2,1,0} parameter(1)
  %x = f32[8,16]{1,0} parameter(2)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,16]{1,0}) tuple(%z, %x)
  %w = (s32[], f32[8,16]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %f = f32[4,8,32]{2,1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
}
"""


def test_dot_flops_through_fusions_and_loops():
    # Batched dot: 2 * 4*8*32 outputs * 16; loop body: [16, 16] <- contract 8, three times.
    assert hlo_flops.dot_flops(HLO) == 2 * 4 * 8 * 32 * 16 + 3 * 2 * 16 * 16 * 8


def test_trip_count_and_loop_bytes():
    comps = hlo_flops.hlo_bytes.parse_hlo(HLO)
    loop = next(i for i in comps["main"].instrs if i.opcode == "while")
    assert hlo_flops.trip_count(loop) == 3
    # The fusion reads a and b and writes its output; the loop body's dot reads x (once per
    # operand, as hlo_bytes counts) and writes y, three times; tuples and parameters are free.
    fusion = 4 * (4 * 8 * 16 + 4 * 16 * 32 + 4 * 8 * 32)
    assert hlo_flops.hbm_bytes(HLO) == fusion + 3 * 4 * (2 * 8 * 16 + 16 * 16)
