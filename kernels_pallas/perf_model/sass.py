"""SASS of a Mosaic GPU kernel: disassemble the compiled kernel and count its main loop.

The deviceless H100 compile (``kernels_pallas/aot.py``) leaves Mosaic GPU's PTX in its dump
directory; ``ptxas -arch=sm_90a`` (the ``nvidia-cuda-nvcc-cu12`` wheel) makes a cubin and
``cuobjdump -sass`` (``nvidia-cuda-cuobjdump`` wheel, with ``nvdisasm`` from
``nvidia-cuda-nvdisasm`` on PATH) prints its SASS, on a CPU-only machine. ``loops`` finds the
loops (a backward branch to an earlier address); the kernel's main loop is the innermost one
holding a warpgroup MMA (``HGMMA`` f16/bf16, ``QGMMA`` fp8, ``IGMMA`` int8). ``LoopProfile``
counts its instructions per class: this is what one warp issues per iteration (loop-invariant
waits taken out of line by ptxas, e.g. ``SYNCS`` retry blocks after ``EXIT``, are not counted).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess

_INSTR_RE = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)([.A-Za-z0-9_]*)\s*([^;]*);"
)
_BRA_TARGET_RE = re.compile(r"0x([0-9a-f]+)")
MMA_OPS = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")


@dataclasses.dataclass(frozen=True)
class Instr:
    addr: int
    op: str  # opcode without modifiers, e.g. "FFMA"
    mods: str  # ".E4M3.E4M3..." etc.
    operands: str


@dataclasses.dataclass(frozen=True)
class LoopProfile:
    """Instruction counts of one loop body (one warp, one iteration)."""

    start: int
    end: int
    total: int
    mma: int  # warpgroup MMA instructions (one per 64 x N x k_inst slice)
    mma_shape: str  # e.g. "64x128x32" from the first MMA's modifiers, "" if unknown
    by_op: dict  # opcode -> count
    # other instructions issued while an MMA group runs: after a group's first warpgroup MMA,
    # before the ``WARPGROUP.DEPBAR`` that waits for it (the promotion ``MgpuConfig.overlap``
    # moves there, the next slice's address arithmetic, scalar loads)
    under_mma: int = 0

    @property
    def non_mma(self) -> int:
        return self.total - self.mma


def parse_sass(text: str) -> list[Instr]:
    out = []
    for m in _INSTR_RE.finditer(text):
        out.append(Instr(int(m[1], 16), m[3], m[4], m[5].strip()))
    return out


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(start, end) address ranges of every backward branch (end = the branch's address), but
    those spanning an ``EXIT``: ptxas places the retry of an mbarrier wait after the kernel's
    exit, branching back to the wait, which is no loop of the kernel's (a wait inside the K
    loop's body would otherwise make the span from it to the retry look like the K loop)."""
    exits = [i.addr for i in instrs if i.op == "EXIT"]
    found = []
    for ins in instrs:
        if ins.op == "BRA":
            t = _BRA_TARGET_RE.search(ins.operands)
            if t and (start := int(t[1], 16)) < ins.addr and \
                    not any(start < e < ins.addr for e in exits):  # fmt: skip
                found.append((start, ins.addr))
    return found


def _profile(instrs: list[Instr], start: int, end: int) -> LoopProfile:
    body = [i for i in instrs if start <= i.addr <= end]
    ops = collections.Counter(i.op for i in body)
    mma = [i for i in body if i.op in MMA_OPS]
    shape = ""
    if mma and (m := re.search(r"\.(\d+x\d+x\d+)", mma[0].mods)):
        shape = m[1]
    under, in_flight = 0, False
    for i in body:
        if i.op in MMA_OPS:
            in_flight = True
        elif i.op == "WARPGROUP" and i.mods.startswith(".DEPBAR"):
            in_flight = False
        elif in_flight and i.op != "WARPGROUP":
            under += 1
    return LoopProfile(start, end, len(body), len(mma), shape, dict(ops), under)


def main_loop(instrs: list[Instr]) -> LoopProfile | None:
    """The innermost loop holding an MMA (the K loop of the compute warpgroup), or None."""
    cands = []
    for start, end in loops(instrs):
        prof = _profile(instrs, start, end)
        if prof.mma:
            cands.append(prof)
    return min(cands, key=lambda p: p.end - p.start) if cands else None


def all_loops(instrs: list[Instr]) -> list[LoopProfile]:
    return [_profile(instrs, s, e) for s, e in loops(instrs)]


def tool(name: str) -> str | None:
    """Path of ``ptxas`` / ``cuobjdump`` / ``nvdisasm``: $PATH, then the nvidia wheels."""
    if found := shutil.which(name):
        return found
    import sys

    roots = [os.path.dirname(os.path.dirname(sys.executable))]
    roots += [os.environ.get("NVTOOLS_ROOT", "")]
    for root in filter(None, roots):
        pat = os.path.join(root, "lib", "python*", "site-packages", "nvidia", "*", "bin", name)
        for cand in glob.glob(pat) + glob.glob(os.path.join(root, "nvidia", "*", "bin", name)):
            if os.access(cand, os.X_OK):
                return cand
    return None


def ptx_to_sass(ptx_path: str, workdir: str) -> tuple[str, str]:
    """(SASS text, ptxas -v report) of one PTX file, compiled for sm_90a.

    Mosaic GPU may stamp a newer ``.version`` than the wheel's ptxas knows (9.0 vs 8.8 for ptxas
    12.9) although it uses nothing newer (it compiled with the plugin's own PTX compiler); the
    version line is lowered to what ptxas accepts.
    """
    ptxas, cuobjdump = tool("ptxas"), tool("cuobjdump")
    if not (ptxas and cuobjdump):
        raise FileNotFoundError("sass: ptxas and cuobjdump are needed (scripts/setup_aot.sh)")
    with open(ptx_path) as f:
        ptx = f.read()
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.8", ptx, count=1, flags=re.M)
    src = os.path.join(workdir, os.path.basename(ptx_path) + ".88.ptx")
    cubin = src + ".cubin"
    with open(src, "w") as f:
        f.write(ptx)
    rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", cubin, src], capture_output=True,
                         text=True, check=True)  # fmt: skip
    env = dict(os.environ)
    if (nvdisasm := tool("nvdisasm")) is not None:
        env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                          check=True, env=env).stdout  # fmt: skip
    return sass, rep.stdout + rep.stderr


def tma_loop(instrs: list[Instr]) -> LoopProfile | None:
    """The innermost loop issuing TMA loads (``UTMALDG``) and no MMA: the producer's K loop."""
    cands = [p for p in all_loops(instrs) if p.by_op.get("UTMALDG") and not p.mma]
    return min(cands, key=lambda p: p.end - p.start) if cands else None


# global memory traffic: TMA loads / stores / bulk copies, plain loads / stores / atomics,
# async copies to SMEM (a read of an operand before the grid dependency wait is a race)
_GLOBAL_ACCESS = (
    "UTMALDG",
    "UTMASTG",
    "UTMAREDG",
    "UBLKCP",
    "LDG",
    "STG",
    "ATOMG",
    "REDG",
    "LDGSTS",
)


def dependent_launch(instrs: list[Instr]) -> dict | None:
    """A dependent-launch kernel's prologue (``kernels_pallas/dependent_launch.py``), or None if
    it does not wait for its predecessor (no ``ACQBULK``, ``griddepcontrol.wait``): the L2
    prefetches (``UTMAPF``) issued before the wait, and the global memory accesses placed before
    it (none in a correct kernel: the prologue is straight-line code, so address order is issue
    order there)."""
    waits = [i.addr for i in instrs if i.op == "ACQBULK"]
    if not waits:
        return None
    first = min(waits)
    before = [i for i in instrs if i.addr < first]
    return dict(
        waits=len(waits),
        prefetches=sum(i.op == "UTMAPF" for i in before),
        accesses_before_wait=sum(i.op in _GLOBAL_ACCESS for i in before),
        triggers=sum(i.op == "PREEXIT" for i in instrs),
    )
