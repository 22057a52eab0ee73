"""The SASS profiles the GPU model predicts from (``sass_profiles.json`` beside this module,
package data: ``fp8_matmul``'s dispatch ranks tiles by them at run time; written by
``profile_gpu.py``): loading them, the producer warpgroup's instructions per K step,
and the profile that stands in for a tile configuration that was not profiled itself."""

from __future__ import annotations

import functools
import json
import os
import re

SASS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sass_profiles.json")
# the benchmark results of the device runs (calibration, the measured rollout)
RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "experiments", "results",
)  # fmt: skip


# a variant name's split-K (``_k4``, ``_k2c``), K-slices (``_s2``) and dependent-launch (``_pdl``)
# suffixes: the producer issues the same loads per step whatever the chunk, the slices per stage
# or the launch
_SPLIT_OR_SLICES = re.compile(r"_k\d+c?(?=_s|_pdl|$)|_s\d+(?=_pdl|$)|_pdl$")


@functools.cache
def load_profiles(path: str = SASS_JSON) -> dict:
    """variant name -> its first kernel's profile (registers, smem, main_loop, tma_loop), with
    ``tma_step``: the producer warpgroup's instructions per K step (``tma_step_instructions``;
    a loop ptxas unrolled completely takes the per-step count of the same tile's other
    variants, the same code in a loop: e.g. ``mm_swap_16x64_k4`` from ``mm_swap_16x64``,
    ``mm_swap_32x64_s4`` from ``mm_swap_32x64(_s2)``)."""
    with open(path) as f:
        data = json.load(f)
    profs = {}
    for name, v in data["variants"].items():
        if v.get("kernels"):
            profs[name] = dict(v["kernels"][0], tma_loads=v.get("tma_loads", 0))
    for prof in profs.values():
        prof["tma_step"] = tma_step_instructions(prof)
    for name, prof in profs.items():
        if prof["tma_step"] is None:  # the producer's K loop fully unrolled: no loop left
            family = _SPLIT_OR_SLICES.sub("", name)
            same = [p["tma_step"] for n, p in profs.items()
                    if _SPLIT_OR_SLICES.sub("", n) == family and p["tma_step"]]  # fmt: skip
            prof["tma_step"] = min(same) if same else 0.0
    return profs


def tma_step_instructions(prof: dict) -> float | None:
    """Instructions one warp of the TMA (producer) warpgroup issues per K step: its loop body
    over the steps ptxas unrolled into one iteration (the loop's ``UTMALDG`` count over the
    loads one step issues, ``tma_loads``: the unsplit QArray kernels' loop holds two steps).
    0 when the compute loop issues the loads itself (no producer warpgroup), None when the
    profile has no producer loop (unrolled completely: ``load_profiles`` fills it in)."""
    main, tma = prof.get("main_loop") or {}, prof.get("tma_loop")
    if main.get("by_op", {}).get("UTMALDG"):
        return 0.0
    if not tma:
        return None
    loads = prof.get("tma_loads") or 0
    steps = tma.get("by_op", {}).get("UTMALDG", 0) / loads if loads else 1
    return tma["total"] / max(steps, 1)


_TILE_NAME = re.compile(r"^(?P<family>.+)_(?P<a>\d+)x(?P<b>\d+)(?P<rest>.*)$")
_SLICES = re.compile(r"_s\d+$")  # MgpuConfig.k_slices > 1


def nearest_profile(name: str, profs: dict) -> dict:
    """The profile of ``name`` (e.g. ``mm_swap_80x128_k2``), else of the same family and column
    tile with the nearest row tile at or above it (more instructions per step: the safe side;
    else the widest profiled), with the same suffix (split-K) if profiled, else unsuffixed;
    else (no profile of that column tile) the same by the next wider column tile; else (no
    tile in the name) the family's last. A K-slices suffix (``_s2``: several 128-K slices a
    step, a longer K loop) is kept: only profiles with it stand in (none: KeyError)."""
    name = name.split(" ")[0]
    if name in profs:
        return profs[name]
    if (want := _TILE_NAME.match(name)) is not None:
        tiles = {}  # row tile -> {suffix: name}
        for k in profs:
            g = _TILE_NAME.match(k)
            if g and (g["family"], g["b"]) == (want["family"], want["b"]):
                tiles.setdefault(int(g["a"]), {})[g["rest"]] = k
        base = _SLICES.search(want["rest"])
        base = base.group() if base else ""
        if base:  # only loops of as many slices a step
            tiles = {a: t for a, s in tiles.items()
                     if (t := {r: n for r, n in s.items() if r.endswith(base)})}  # fmt: skip
            if not tiles:
                raise KeyError(f"perf_model.gpu: no SASS profile for {name} (run profile_gpu)")
        if tiles:
            above = [a for a in tiles if a >= int(want["a"])]
            same = tiles[min(above) if above else max(tiles)]
            return profs[same.get(want["rest"]) or same.get(base) or next(iter(same.values()))]
        cols = sorted({int(g["b"]) for k in profs if (g := _TILE_NAME.match(k)) is not None
                       and g["family"] == want["family"]})  # fmt: skip
        if wider := [b for b in cols if b > int(want["b"])]:  # more work per step: safe side
            return nearest_profile(f"{want['family']}_{want['a']}x{wider[0]}{want['rest']}", profs)
    family = name.rsplit("_", 1)[0]  # e.g. decode_fp8_x -> nearest decode_fp8_* profiled
    cands = sorted(k for k in profs if k.startswith(family))
    if not cands:
        raise KeyError(f"perf_model.gpu: no SASS profile for {name} (run profile_gpu)")
    return profs[cands[-1]]
