"""The TPU prediction table: every TPU kernel at the AOT cases' real shapes, before (the wave-2
design) and now (the block shapes the kernels' own planners pick), on v5e and v6e.

  PYTHONPATH=$PWD python -m kernels_pallas.perf_model.tpu_table  # prints, writes JSON + markdown

Rows: ``kernel, target, shape, before_us, now_us, baseline_us, ratio_before, ratio_now, bound``
(ratio = baseline time / kernel time; the baseline is XLA's BF16 matmul for the matmuls and a
BF16-cache kernel at the HBM roofline for attention, ``tpu_attention.py``). The shapes come from
each op's ``aot_cases.py``.
"""

from __future__ import annotations

import json
import os
import sys

from kernels_pallas.perf_model import tpu as model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "experiments", "results", "perf_model_tpu")


def _legacy_matmul_tiles(m: int, k: int) -> model.MatmulTiles:
    """The wave-2 dense kernel's rules: 256 x 128 x 512 (K % 512: 128), rows padded to 32."""
    bm = min(256, -(-m // 32) * 32)
    bk = 512 if k % 512 == 0 else 128
    return model.MatmulTiles(bm, 128, bk, fp8_mxu=False)


def _legacy_grouped_tiles(rows: int, k: int, experts: int) -> model.MatmulTiles:
    mean = max(-(-rows // experts), 1)
    bm = min(max(1 << (mean - 1).bit_length(), 32), 512)
    bk = max(b for b in range(128, 513, 128) if k % b == 0)
    return model.MatmulTiles(bm, 128, bk, fp8_mxu=False)


def matmul_tiles(chip: model.TpuChip, m: int, k: int, n: int) -> model.MatmulTiles:
    from kernels_pallas.fp8_matmul import pallas_tpu as tpu

    p = tpu.plan(m, k, n, None, fp8_mxu=chip.fp8_mxu)
    return model.MatmulTiles(p.block_m, p.block_n, p.block_k, fp8_mxu=p.fp8_mxu, pack=p.pack,
                             dequant=p.dequant)  # fmt: skip


def grouped_tiles(chip: model.TpuChip, rows: int, k: int, ns, e: int,
                  cfg=None) -> model.MatmulTiles:  # fmt: skip
    from kernels_pallas.grouped_fp8_matmul import pallas_tpu as tpu

    p = tpu.plan(rows, k, ns, e, cfg, fp8_mxu=chip.fp8_mxu)
    reuse = tpu.weight_reuse(p, k, ns)
    return model.MatmulTiles(p.block_m, p.block_n, p.block_k, fp8_mxu=p.fp8_mxu, pack=p.pack,
                             dequant=p.dequant, weight_reuse=reuse)  # fmt: skip


def pair(before: model.Prediction, now: model.Prediction) -> dict:
    return dict(
        kernel=now.kernel, target=now.target, shape=now.shape,
        before_us=round(before.time_s * 1e6, 2), now_us=round(now.time_s * 1e6, 2),
        baseline_us=round(now.baseline_s * 1e6, 2), ratio_before=round(before.ratio, 3),
        ratio_now=round(now.ratio, 3), bound=now.bound, steps_before=before.steps,
        steps_now=now.steps, detail_before=before.detail, detail_now=now.detail,
    )  # fmt: skip


def matmul_rows() -> list[dict]:
    from kernels_pallas.fp8_matmul.aot_cases import LAYERS

    rows = []
    for chip in model.CHIPS.values():
        for name, layer, k, n, ms in LAYERS:
            for m in ms:
                shape = f"{name} {layer} M={m} K={k} N={n}"
                args = (chip, m, k, n)
                before = model.fp8_matmul_predict(*args, _legacy_matmul_tiles(m, k),
                                                  "fp8_matmul", shape)  # fmt: skip
                now = model.fp8_matmul_predict(*args, matmul_tiles(*args), "fp8_matmul", shape)
                rows.append(pair(before, now))
    return rows


def grouped_rows(cfg=None) -> list[dict]:
    from kernels_pallas.grouped_fp8_matmul.aot_cases import ALL_ROWS, LAYERS, E

    rows = []
    for chip in model.CHIPS.values():
        for layer, k, ns in LAYERS:
            n = sum(ns)
            for r in ALL_ROWS:
                shape = f"Qwen3-30B-A3B {layer} rows={r} K={k} N={n} E={E}"
                legacy = _legacy_grouped_tiles(r, k, E)
                now_t = grouped_tiles(chip, r, k, ns, E, cfg)
                pred = model.grouped_fp8_matmul_predict
                before = pred(chip, r, k, n, E, legacy, "grouped_fp8_matmul", shape)
                now = pred(chip, r, k, n, E, now_t, "grouped_fp8_matmul", shape)
                rows.append(pair(before, now))
    return rows


def case_shapes() -> list[tuple[str, str, dict]]:
    """(op, label, dims) of every TPU case, in ``common``'s dim names, from the aot_cases."""
    from kernels_pallas.decode_attention.aot_cases import SHAPES as DENSE
    from kernels_pallas.fp8_matmul.aot_cases import LAYERS
    from kernels_pallas.grouped_fp8_matmul.aot_cases import ALL_ROWS, E
    from kernels_pallas.grouped_fp8_matmul.aot_cases import LAYERS as MOE
    from kernels_pallas.paged_attention.aot_cases import SHAPES as PAGED

    out = []
    for name, layer, k, n, ms in LAYERS:
        for m in ms:
            out.append(("fp8_matmul", f"{name} {layer} M={m}", dict(M=m, N=n, K=k, x="fp8")))
    for layer, k, ns in MOE:
        for r in ALL_ROWS:
            dims = dict(M=r, N=ns, K=k, E=E, x="fp8")  # N of each weight stack
            out.append(("grouped_fp8_matmul", f"Qwen3-30B-A3B {layer} rows={r}", dims))
    for name, b, s, h, kv in DENSE:
        dims = dict(B=b, S=s, H=h, KV=kv, D=128, cache="fp8")
        out.append(("decode_attention", f"{name} B={b} S={s}", dims))
    for name, b, _, y, w, h, kv in PAGED:
        dims = dict(B=b, S=w * y, H=h, KV=kv, D=128, cache="fp8", Y=y)
        out.append(("paged_attention", f"{name} B={b} pages {w}x{y}", dims))
    return out


def table() -> list[dict]:
    from kernels_pallas.perf_model import tpu_attention

    return matmul_rows() + grouped_rows() + tpu_attention.rows()


def markdown(rows: list[dict]) -> str:
    head = "| kernel | TPU | shape | before us | now us | BF16 base us | x before | x now | bound |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['target']} | {r['shape']} | {r['before_us']} | {r['now_us']} "
            f"| {r['baseline_us']} | {r['ratio_before']} | {r['ratio_now']} | {r['bound']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    rows = table()
    text = markdown(rows)
    if "--no-write" not in argv:
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT + ".json", "w") as f:
            json.dump(dict(assumptions=model.__doc__, rows=rows), f, indent=1)
        with open(OUT + ".md", "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
