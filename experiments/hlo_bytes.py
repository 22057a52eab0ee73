"""HBM bytes of one iteration of a while loop, counted from optimized HLO text.

Deviceless compiles have no cost analysis, so ``experiments/bench_bytes.py`` counts from
``compiled.as_text()``. After XLA's GPU pipeline every top-level instruction of a computation is
one kernel (a fusion, a custom call such as a Pallas kernel, a copy) or a free view; a kernel
reads its operands from HBM and writes its outputs to HBM. The counting rule, per top-level
instruction of the loop body (and of the loop condition):

  * free (0 bytes): parameter, get-tuple-element, tuple, bitcast, constant, and the other
    view or token ops in ``FREE``;
  * fusion: every operand is read once, every output written once, except
      - an operand that the fused computation only slices (slice, dynamic-slice, gather as the
        sliced operand, possibly through bitcasts/reshapes) counts the sliced bytes;
      - an in-place update: an output element that is a dynamic-update-slice or scatter into a
        parameter (through bitcasts) aliases that parameter's buffer, so it counts the update's
        bytes as written and nothing as read for that buffer;
  * custom-call: all operands read, all outputs written, except outputs aliased to an operand
    (``output_to_operand_aliasing``, written in place: their bytes are not known, 0 is
    counted) and ``s8`` workspace outputs;
  * top-level dynamic-update-slice / scatter: in place, the update's bytes; slice, dynamic-slice
    and gather: the output's bytes read and written;
  * call: its computation counted the same way; conditional: the largest branch; a nested while:
    its body once (the result says how many nested loops were counted so);
  * anything else (copy, sort, reduce, ...): operands read and outputs written in full.

Bytes of a shape are ``prod(dims) * itemsize`` summed over the arrays of a tuple.
"""

from __future__ import annotations

import dataclasses
import math
import re

ITEMSIZE = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}  # fmt: skip
FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "add-dependency", "opt-barrier", "partition-id", "replica-id", "copy-done", "domain",
}  # fmt: skip
VIEWS = {"bitcast", "reshape"}
SLICES = {"slice", "dynamic-slice", "gather"}
IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand index of the update

_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([<=\d,]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_NAME_RE = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the result shape text, e.g. "bf16[64,4096]{1,0}" or "(f32[2], s32[])"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    args: str = ""  # the operand list's text (a parameter's number, a constant's literal)
    is_root: bool = False


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    is_entry: bool = False

    @property
    def by_name(self) -> dict[str, Instr]:
        return {i.name: i for i in self.instrs}

    @property
    def root(self) -> Instr:
        return next((i for i in self.instrs if i.is_root), self.instrs[-1])


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (arrays of a tuple summed); f8 types are one byte."""
    total = 0.0
    for dtype, dims in _ARRAY_RE.findall(shape):
        size = 1 if dtype.startswith("f8") else ITEMSIZE.get(dtype)
        if size is None:
            raise ValueError(f"hlo_bytes: unknown element type {dtype!r} in {shape!r}")
        n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
        total += n * size
    return int(total)


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"hlo_bytes: unbalanced brackets in {text[:120]!r}")


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    root, name, rest = m.groups()
    end = _matching(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op_m = re.match(r"([\w\-]+)\(", rest)
    if op_m is None:
        return None
    close = _matching(rest, op_m.end() - 1)
    operands = _NAME_RE.findall(rest[op_m.end() : close - 1])
    args = rest[op_m.end() : close - 1]
    return Instr(name, shape, op_m.group(1), operands, rest[close:], args, bool(root))


def parse_hlo(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text by name (instructions in order)."""
    comps, current = {}, None
    for line in text.splitlines():
        if current is None:
            h = _HEADER_RE.match(line)
            if h:
                current = Computation(h.group(2), [], bool(h.group(1)))
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.instrs.append(instr)
    return comps


def _attr(instr: Instr, key: str) -> list[str]:
    """Computation names in ``key=%c`` or ``key={%a, %b}`` of an instruction's attributes."""
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", instr.attrs)
    return _NAME_RE.findall(m.group(1)) if m else []


def _through_views(comp: Computation, name: str) -> Instr:
    by = comp.by_name
    instr = by[name]
    while instr.opcode in VIEWS:
        instr = by[instr.operands[0]]
    return instr


def _views_of(comp: Computation, name: str) -> set[str]:
    """``name`` and every bitcast/reshape of it."""
    names, grew = {name}, True
    while grew:
        new = {i.name for i in comp.instrs if i.opcode in VIEWS and i.operands[0] in names}
        grew = not new <= names
        names |= new
    return names


def _users(comp: Computation, names: set[str]) -> list[Instr]:
    """Non-view instructions that take one of ``names`` as an operand."""
    return [i for i in comp.instrs if i.opcode not in VIEWS and names & set(i.operands)]


def _fusion_bytes(instr: Instr, comps: dict[str, Computation], shapes: dict[str, str]) -> int:
    fused = comps[_attr(instr, "calls")[0]]
    params = {int(i.args): i for i in fused.instrs if i.opcode == "parameter"}
    root = fused.root
    outs = [fused.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    written, in_place = 0, set()
    for out in outs:
        upd = IN_PLACE.get(out.opcode)
        base = _through_views(fused, out.operands[0]) if upd is not None else None
        if base is not None and base.opcode == "parameter":
            in_place.add(base.name)
            written += shape_bytes(fused.by_name[out.operands[upd]].shape)
        else:
            written += shape_bytes(out.shape)
    read = 0
    for idx, operand in enumerate(instr.operands):
        p = params.get(idx)
        views = _views_of(fused, p.name) if p is not None else set()
        users = _users(fused, views)
        if p is not None and p.name in in_place and all(IN_PLACE.get(u.opcode) for u in users):
            continue  # the buffer updated in place: only the update's bytes (written) count
        if users and all(u.opcode in SLICES and u.operands[0] in views for u in users):
            read += sum(shape_bytes(u.shape) for u in users)
        else:
            read += shape_bytes(shapes[operand])
    return read + written


def _custom_call_bytes(instr: Instr, shapes: dict[str, str]) -> int:
    read = sum(shape_bytes(shapes[o]) for o in instr.operands)
    outs = _ARRAY_RE.findall(instr.shape)
    aliased = set()
    m = re.search(r"output_to_operand_aliasing=\{(.*?)\}\s*(,|$)", instr.attrs)
    if m:
        aliased = {int(x or 0) for x in re.findall(r"\{(\d*)\}:\s*\(", m.group(1))}
    written = sum(
        shape_bytes(f"{dt}[{dims}]")
        for k, (dt, dims) in enumerate(outs)
        if k not in aliased and not (dt == "s8" and len(outs) > 1)
    )
    return read + written


@dataclasses.dataclass
class LoopBytes:
    """Bytes of one loop iteration, with the largest contributors."""

    total: int
    per_instr: list[tuple[str, str, int]]  # (instruction, opcode, bytes), largest first
    nested_loops: int  # nested whiles counted once


def computation_bytes(comps: dict[str, Computation], name: str, acc: LoopBytes) -> int:
    """Bytes of one execution of computation ``name`` (the rule in the module docstring)."""
    comp = comps[name]
    shapes = {i.name: i.shape for i in comp.instrs}
    total = 0
    for i in comp.instrs:
        if i.opcode in FREE:
            continue
        if i.opcode == "fusion":
            b = _fusion_bytes(i, comps, shapes)
        elif i.opcode == "custom-call":
            b = _custom_call_bytes(i, shapes)
        elif i.opcode in IN_PLACE:
            upd = IN_PLACE[i.opcode]
            b = sum(shape_bytes(shapes[o]) for k, o in enumerate(i.operands) if k) + shape_bytes(
                shapes[i.operands[upd]]
            )
        elif i.opcode in SLICES:
            b = 2 * shape_bytes(i.shape)
        elif i.opcode == "call":
            b = computation_bytes(comps, _attr(i, "to_apply")[0], acc)
        elif i.opcode == "conditional":
            branches = _attr(i, "branch_computations") or (
                _attr(i, "true_computation") + _attr(i, "false_computation")
            )
            b = max(computation_bytes(comps, c, LoopBytes(0, [], 0)) for c in branches)
        elif i.opcode == "while":
            acc.nested_loops += 1
            b = computation_bytes(comps, _attr(i, "body")[0], acc)
        else:
            b = sum(shape_bytes(shapes[o]) for o in i.operands) + shape_bytes(i.shape)
        if i.opcode not in ("call", "while"):
            acc.per_instr.append((i.name, i.opcode, b))
        total += b
    return total


def find_loop(comps: dict[str, Computation]) -> Instr:
    """The while instruction of the entry computation with the largest body."""
    entry = next(c for c in comps.values() if c.is_entry)
    loops = [i for i in entry.instrs if i.opcode == "while"]
    if not loops:
        raise ValueError("hlo_bytes: the entry computation has no while loop")
    return max(loops, key=lambda w: len(comps[_attr(w, "body")[0]].instrs))


def loop_iteration_bytes(hlo_text: str) -> LoopBytes:
    """HBM bytes of one iteration (body + condition) of the entry's main while loop."""
    comps = parse_hlo(hlo_text)
    loop = find_loop(comps)
    acc = LoopBytes(0, [], 0)
    acc.total = computation_bytes(comps, _attr(loop, "body")[0], acc)
    acc.total += computation_bytes(comps, _attr(loop, "condition")[0], acc)
    acc.per_instr.sort(key=lambda t: -t[2])
    return acc
