"""FLOPs and HBM bytes of an optimized HLO module, loops counted by their trip count.

``hlo_bytes`` counts one iteration of a rollout's decode loop; these count a whole program (a
benchmark's jitted call): every ``dot``'s FLOPs, and the entry computation's HBM bytes by the
``hlo_bytes`` rules, with each ``while`` (e.g. a ``lax.map``) times its known trip count.
"""

from __future__ import annotations

import math
import re

from experiments import hlo_bytes


def trip_count(instr: hlo_bytes.Instr) -> int:
    """A while loop's ``known_trip_count`` (1 if XLA did not record one)."""
    m = re.search(r'known_trip_count":\{"n":"(\d+)"', instr.attrs)
    return int(m.group(1)) if m else 1


def _dims(shape: str) -> list[int]:
    return [int(d) for d in re.search(r"\[([\d,]*)\]", shape)[1].split(",") if d]


def _dot(instr: hlo_bytes.Instr, shapes: dict[str, str]) -> int:
    """``2 · |out| · |contracted|`` of one dot."""
    lhs = _dims(shapes[instr.operands[0]])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)[1]
    k = math.prod(lhs[int(c)] for c in contracting.split(",") if c)
    return 2 * k * math.prod(_dims(instr.shape))


def dot_flops(hlo_text: str) -> int:
    """FLOPs of every ``dot`` reachable from the entry (fusions, calls, loop bodies)."""
    comps = hlo_bytes.parse_hlo(hlo_text)

    def comp_flops(name: str) -> int:
        comp = comps[name]
        shapes = {i.name: i.shape for i in comp.instrs}
        total = 0
        for i in comp.instrs:
            if i.opcode == "dot":
                total += _dot(i, shapes)
            elif i.opcode == "while":
                total += trip_count(i) * comp_flops(hlo_bytes._attr(i, "body")[0])
            else:
                called = hlo_bytes._attr(i, "calls") + hlo_bytes._attr(i, "to_apply")
                total += sum(comp_flops(c) for c in called if c in comps)
        return total

    entry = next(c for c in comps.values() if c.is_entry)
    return comp_flops(entry.name)


def hbm_bytes(hlo_text: str) -> int:
    """HBM bytes of the entry computation (``hlo_bytes`` rules), loops times their trip count."""
    comps = hlo_bytes.parse_hlo(hlo_text)
    entry = next(c for c in comps.values() if c.is_entry)
    acc = hlo_bytes.LoopBytes(0, [], 0)
    total = hlo_bytes.computation_bytes(comps, entry.name, acc)  # while bodies counted once
    for i in entry.instrs:
        if i.opcode == "while" and trip_count(i) > 1:
            body = hlo_bytes._attr(i, "body")[0]
            total += (trip_count(i) - 1) * hlo_bytes.computation_bytes(comps, body, acc)
    return total
