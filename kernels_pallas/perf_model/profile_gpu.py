"""Compile each Mosaic GPU kernel variant for H100 (no device) and record its SASS profile.

``python -m kernels_pallas.perf_model.profile_gpu`` (AOT venv: ``scripts/setup_aot.sh``) writes
``kernels_pallas/perf_model/sass_profiles.json``: per variant, ptxas registers and spills, Mosaic's
SMEM, and the instruction counts of the compute warpgroup's main loop and of the TMA warpgroup's
loop (``sass.py``). ``gpu.py`` predicts from that file, so the model itself runs anywhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import glob
import json
import multiprocessing
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "kernels_pallas", "perf_model", "sass_profiles.json")


# (M rows, N rows, K chunks, 128-K slices a step, stages) of the profiled swap-AB tiles with
# several slices a step (FP8 x), and of the fused (BF16 x) decode tiles
# fmt: off
SWAP_SLICE_TILES = ((32, 128, 1, 2, 4), (32, 128, 1, 4, 2), (32, 64, 1, 2, 4), (32, 64, 1, 4, 4),
                    (64, 128, 1, 2, 4), (64, 64, 1, 2, 4), (128, 128, 1, 2, 2), (32, 128, 2, 2, 4),
                    (64, 128, 2, 2, 3))
FUSED_SWAP_TILES = ((16, 128, 2, 2, 4), (16, 128, 1, 2, 4), (16, 64, 1, 2, 4), (32, 128, 2, 2, 3),
                    (32, 128, 1, 2, 4), (32, 64, 1, 2, 4), (64, 128, 2, 1, 4), (64, 128, 1, 1, 4),
                    (64, 64, 1, 2, 4))
# fmt: on


def variants() -> dict:
    """name -> (fn, args, meta): one representative compile per kernel variant (the loop body
    depends on the tile configuration, not on M, N, K)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.decode_attention import aot_cases as dac
    from kernels_pallas.decode_attention.common import DecodeBlocks
    from kernels_pallas.fp8_matmul import aot_cases as mac
    from kernels_pallas.fp8_matmul import pallas_mosaic_gpu as mgpu
    from kernels_pallas.paged_attention import aot_cases as pac
    from kernels_pallas.paged_attention.common import PagedBlocks

    def mm(m, x_kind, cfg=None):
        fn = functools.partial(mac._call, impl="pallas_mosaic_gpu", out_dtype="bfloat16",
                               config=cfg)  # fmt: skip
        return fn, mac._operands(m, 4096, 4096, x_kind)

    def dec(cache, swap_ab=None, block_s=None):
        cfg = DecodeBlocks(block_s=block_s, swap_ab=swap_ab)
        fn = functools.partial(dac._call, impl="pallas_mosaic_gpu", config=cfg)
        return fn, dac._operands(32, 8192, 32, 8, cache)

    def paged(cache, swap_ab=None):
        cfg = PagedBlocks(swap_ab=swap_ab)
        fn = functools.partial(pac._call, impl="pallas_mosaic_gpu", config=cfg)
        return fn, pac._operands(32, 16384, 64, 320, 32, 8, cache)

    def gmm(kind, out=jnp.bfloat16):  # the BF16 grouped kernels at Qwen3-30B-A3B gate/up, E 16
        from kernels_pallas.grouped_matmul import pallas_mosaic_gpu as bf16

        sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
        x, gs = sds((32768, 2048), bf), sds((16,), jnp.int32)
        if kind == "tgmm":
            tgmm = functools.partial(bf16.tgmm_mgpu, out_dtype=out)  # BF16: the training pass
            return tgmm, (x, sds((32768, 768), bf), gs)
        w = sds((16, 768, 2048) if kind == "dgrad" else (16, 2048, 768), bf)
        return functools.partial(bf16.gmm_mgpu, transpose_w=kind == "dgrad"), (x, w, gs)

    def gfp8(rows, cfg):  # the grouped FP8 kernel (MoE rollout experts): Qwen3-30B-A3B
        from kernels_pallas.grouped_fp8_matmul import aot_cases as gac  # gate+up, one launch

        fn = functools.partial(gac._call, impl="pallas_mosaic_gpu", out_dtype="bfloat16",
                               config=cfg)  # fmt: skip
        return fn, gac._operands(rows, gac.D, (gac.F, gac.F), "fp8")

    def swaps(family, x_kind, loads, tiles, pdl=False):
        """Swap-AB variants ``{family}_{M}x{N}[_k{split}c][_s{slices}]`` of (M, N, split,
        slices, stages) tiles, K chunks summed in-cluster."""
        return {
            f"{family}_{m}x{n}" + (f"_k{s}c" if s > 1 else "") + (f"_s{ks}" if ks > 1 else ""): (
                *mm(m, x_kind, G(m, n, st, True, s, cluster_k=s > 1, k_slices=ks, pdl=pdl)),
                loads,
            )
            for m, n, s, ks, st in tiles
        }

    # The TMA loads one K step issues (its BlockSpecs): the producer warpgroup's loop issues
    # this many per step, so its UTMALDG count says how many steps ptxas unrolled into one
    # iteration (``gpu.tma_step_instructions``).
    mm_loads, two = {"tma_loads": 3}, {"tma_loads": 2}  # x, w, s_x | x, w or K, V
    G, P = mgpu.MgpuConfig, 132
    GO = functools.partial(G, overlap=True)  # promotions under the wgmmas
    c2_p = dict(cluster_m=2, persistent=P)
    out = {
        "mm_qarray_128x128": (*mm(4096, "fp8", G(128, 128, 4)), mm_loads),
        "mm_qarray_64x128": (*mm(4096, "fp8", G(64, 128, 4)), mm_loads),
        # N % 128 != 0 (DeepSeek-V3 q_a+kv_a, N = 2112): 64-column tiles, in 2-CTA clusters
        "mm_qarray_128x64": (*mm(4096, "fp8", G(128, 64, 4)), mm_loads),
        "mm_qarray_128x64_c2": (*mm(4096, "fp8", G(128, 64, 4, cluster_m=2)), mm_loads),
        "mm_qarray_128x256": (*mm(4096, "fp8", G(128, 256, 3)), mm_loads),
        "mm_qarray_256x128": (*mm(4096, "fp8", G(256, 128, 3)), mm_loads),
        "mm_qarray_128x256_c2": (*mm(4096, "fp8", G(128, 256, 3, cluster_m=2)), mm_loads),
        "mm_qarray_128x128_c2": (*mm(4096, "fp8", G(128, 128, 4, cluster_m=2)), mm_loads),
        # promotions under the wgmmas (MgpuConfig.overlap): two 128-K slices per step, x scales
        # from GMEM (two TMA loads a step)
        "mm_qarray_128x128_c2_o": (*mm(4096, "fp8", GO(128, 128, 3, cluster_m=2)), two),
        "mm_qarray_128x64_c2_o": (*mm(4096, "fp8", GO(128, 64, 3, cluster_m=2)), two),
        "mm_qarray_128x128_o": (*mm(4096, "fp8", GO(128, 128, 3)), two),
        # the persistent grid (132 CTAs, snake tile order) on the prefill tiles
        "mm_qarray_128x128_p": (*mm(4096, "fp8", G(128, 128, 4, persistent=P)), mm_loads),
        "mm_qarray_128x256_p": (*mm(4096, "fp8", G(128, 256, 3, persistent=P)), mm_loads),
        "mm_qarray_128x128_c2_p": (*mm(4096, "fp8", G(128, 128, 4, **c2_p)), mm_loads),
        "mm_qarray_128x256_c2_p": (*mm(4096, "fp8", G(128, 256, 3, **c2_p)), mm_loads),
        "mm_fused_128x128": (*mm(4096, "bf16", G(128, 128, 3)), two),
        "mm_swap_32x64": (*mm(32, "fp8", G(32, 64, 4, True)), mm_loads),
        "mm_swap_64x64": (*mm(64, "fp8", G(64, 64, 4, True)), mm_loads),
        # split-K (32 rows: the smallest swap tile, mgpu_config.SWAP_ROW_ALIGN; 64-row tiles:
        # 2 for 64-CTA grids, 4-8 for k/v widths; decode_split_k)
        **{
            f"mm_swap_{m}x64_k{s}": (*mm(m, "fp8", G(m, 64, 4, True, s)), mm_loads)
            for m, s in ((32, 2), (32, 4), (32, 8), (64, 2), (64, 8))
        },
        # 128 weight rows per CTA: two compute warpgroups of 64 (the decode default where N %
        # 128 == 0: two wgmma chains per SM and half the x re-reads of 64-row tiles)
        **{
            f"mm_swap_{m}x128" + (f"_k{s}" if s > 1 else ""): (
                *mm(m, "fp8", G(m, 128, 4, True, s)),
                mm_loads,
            )
            for m, s in ((32, 1), (64, 1), (32, 2), (32, 4), (32, 8), (64, 2), (64, 4))
        },
        # up to 128 x rows (the wgmma N) for decode batches of 65-256 rows
        **{
            f"mm_swap_{m}x128" + (f"_k{s}" if s > 1 else ""): (
                *mm(m, "fp8", G(m, 128, 4, True, s)),
                mm_loads,
            )
            for m, s in ((96, 1), (128, 1), (128, 2), (128, 4), (128, 8))
        },
        # the decode default's two K chunks summed in their cluster (cluster_k): same K loop
        **{
            f"mm_swap_{m}x128_k2c": (*mm(m, "fp8", G(m, 128, 4, True, 2, cluster_k=True)), mm_loads)
            for m in (32, 64, 128)
        },  # fmt: skip
        # several 128-K slices per step (MgpuConfig.k_slices): the same K loop at every split
        **swaps("mm_swap", "fp8", mm_loads, SWAP_SLICE_TILES),
        # the decode default (Qwen3-8B o_proj, M = 16) launched dependent (MgpuConfig.pdl): the
        # same K loop; its prologue prefetches the first ring's weights (8 slices) to L2, then
        # waits for the predecessor before any load (``sass.dependent_launch``)
        "mm_swap_32x128_k2c_s2_pdl": (
            *mm(32, "fp8", G(32, 128, 4, True, 2, cluster_k=True, k_slices=2, pdl=True)),
            mm_loads,
        ),
        # the fused (BF16 x) decode tiles (the default at M = 16, ``api.fused_default``; 32
        # and 64 rows for the autotuner): the compute warpgroups split the tile's x rows'
        # quantization per 128-K slice (``mgpu_fused_swap``; x and w: two TMA loads a step)
        **swaps("mm_fused_swap", "bf16", two, FUSED_SWAP_TILES, pdl=True),
        "mm_swap_128x64": (*mm(128, "fp8", G(128, 64, 4, True)), mm_loads),  # N % 128 != 0
        "mm_swap_128x64_k4": (*mm(128, "fp8", G(128, 64, 4, True, 4)), mm_loads),
        # decode attention: swap-AB (the default), and unswapped (the query group padded to 64)
        "decode_fp8": (*dec("fp8_static"), two),
        "decode_fp8_bs128": (*dec("fp8_static", block_s=128), two),  # the autotuner's candidate
        "decode_bf16": (*dec("bf16"), two),
        "paged_fp8": (*paged("fp8_static"), two),
        "decode_fp8_unswapped": (*dec("fp8_static", False), two),
        "decode_bf16_unswapped": (*dec("bf16", False), two),
        "paged_fp8_unswapped": (*paged("fp8_static", False), two),
        # the grouped FP8 kernel's default tiles (``grouped_fp8_matmul.default_config``): swap-AB
        # 32 / 64 rows for decode-sized groups (< 32 / 64 rows per expert), wide 128x256
        # above (128x128 where N % 256 != 0; 256x128 for the autotuner); ragged stores
        "gfp8_swap_32x64": (*gfp8(512, G(32, 64, 4, True)), mm_loads),
        "gfp8_swap_64x64": (*gfp8(4096, G(64, 64, 4, True)), mm_loads),
        "gfp8_swap_32x128": (*gfp8(512, G(32, 128, 4, True)), mm_loads),
        "gfp8_swap_64x128": (*gfp8(4096, G(64, 128, 4, True)), mm_loads),
        "gfp8_128x128": (*gfp8(65536, G(128, 128, 4)), mm_loads),
        "gfp8_128x256": (*gfp8(65536, G(128, 256, 3)), mm_loads),
        "gfp8_256x128": (*gfp8(65536, G(256, 128, 3)), mm_loads),
        # the BF16 grouped kernels' defaults (128x256 tiles of two compute warpgroups: forward,
        # input gradient, weight gradient with a BF16 dw); ``gmm_bf16_128x128[_t]_1wg`` and
        # ``tgmm_bf16_128x128_1wg``, kept in the JSON, are the one-warpgroup kernels of before
        # (``gpu_grouped.design_changes``)
        "gmm_bf16_128x256": (*gmm("fwd"), two),
        "gmm_bf16_128x256_t": (*gmm("dgrad"), two),
        "tgmm_bf16_128x256": (*gmm("tgmm"), two),
        "tgmm_bf16_128x128": (*gmm("tgmm", jnp.float32), two),  # an f32 dw: its default tile
    }
    return out


def profile(fn, args) -> dict:
    """Compile ``fn(*args)`` for H100 with Mosaic GPU's PTX dump kept; profile each kernel."""
    import jax

    from kernels_pallas import aot
    from kernels_pallas.perf_model import sass

    with tempfile.TemporaryDirectory(prefix="perf_model_") as d:
        old = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX")}
        os.environ.update(MOSAIC_GPU_DUMP_TO=d, MOSAIC_GPU_DUMP_PTX="1")
        try:
            mesh = aot.target_mesh("h100")
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                jax.jit(fn).lower(*aot.abstract_args("h100", *args)).compile()
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        kernels = []
        for ptx in sorted(glob.glob(os.path.join(d, "*.ptx"))):
            text, report = sass.ptx_to_sass(ptx, d)
            reps = aot.parse_ptxas(report)
            res = ptx[: -len(".ptx")] + ".resources.txt"
            smem = 0
            if os.path.exists(res):
                with open(res) as f:
                    smem = aot.parse_resources(f.read())
            instrs = sass.parse_sass(text)
            main = sass.main_loop(instrs)
            mem = sass.tma_loop(instrs)
            kernels.append(dict(
                registers=reps[0].registers if reps else None,
                spill_bytes=(reps[0].spill_stores + reps[0].spill_loads) if reps else None,
                smem_bytes=smem, instructions=len(instrs),
                main_loop=dataclasses.asdict(main) if main else None,
                tma_loop=dataclasses.asdict(mem) if mem else None,
                dependent_launch=sass.dependent_launch(instrs),
            ))  # fmt: skip
    return dict(kernels=kernels)


def _worker_init() -> None:
    from kernels_pallas import aot

    aot.prepare_environment()


def _profile_named(name: str) -> dict:
    """One variant's record (in a worker process): its profile and meta, or the error."""
    import jax

    fn, fargs, meta = variants()[name]
    try:
        return dict(profile(fn, fargs), **meta)
    except Exception as e:  # a variant that does not compile is reported, not fatal
        return dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        jax.clear_caches()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--only", action="append", help="variant names (repeatable)")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes at once")
    args = ap.parse_args(argv)
    from kernels_pallas import aot
    from kernels_pallas.perf_model import gpu

    aot.prepare_environment()
    import jax

    data = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    data.setdefault("variants", {})
    data["jax"] = jax.__version__
    names = [n for n in variants() if not args.only or n in args.only]
    ctx = multiprocessing.get_context("spawn")  # fresh jax per worker (no forked backends)
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx,
                                                initializer=_worker_init) as pool:  # fmt: skip
        for name, rec in zip(names, pool.map(_profile_named, names), strict=True):
            data["variants"][name] = rec
            meta = {"tma_loads": rec.get("tma_loads")}
            k = (rec.get("kernels") or [{}])[0]
            ml = k.get("main_loop") or {}
            line = f"{name:22s} regs={k.get('registers')} spills={k.get('spill_bytes')} "
            line += f"smem={k.get('smem_bytes')} main loop: {ml.get('total')} instr, "
            line += f"{ml.get('mma')} MMA {ml.get('mma_shape')}"
            if k and (step := gpu.tma_step_instructions(dict(k, **meta))):
                line += f", TMA {step:.0f} instr/step"
            line += f" {rec.get('error', '')}"
            print(line, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
