"""What a block-FP8 export must look like for vLLM, SGLang and transformers to load it right.

The rules, read from their loaders (the same list, with the checks, is in
``tests/test_hf_serving_rules.py``):

1. **Fused partitions are whole blocks.** vLLM ``validate_fp8_block_shape``
   (``model_executor/layers/quantization/utils/fp8_utils.py``) checks every merged partition of
   ``qkv_proj`` / ``gate_up_proj`` but the last against ``block_n``; SGLang's copy of it
   (``srt/layers/quantization/fp8_utils.py``, called from ``Fp8LinearMethod.create_weights``)
   checks all. Both FP8 MoE methods need the expert intermediate size divisible by the block.
2. **No partial blocks.** transformers' ``Fp8Dequantize`` (``integrations/finegrained_fp8.py``)
   infers the block from the grids (``rows // scale_rows``), so a weight of 192 rows with
   ``ceil(192/128) = 2`` scale rows is dequantized with 96-row blocks, silently. We never write a
   partial block: an FP8 weight has ``N % bn == 0`` and ``K % bk == 0`` (DeepSeek-V3's readers
   would accept a ceil grid; padding the weight instead would change its shape, which every
   reader checks against ``config.json``). Rule 1 follows from rule 2 for our per-projection
   tensors.
3. **Every BF16 linear is listed, under both names.** vLLM ``Fp8Config.get_quant_method``
   (``quantization/fp8.py``) asks ``is_layer_skipped(prefix, ignored_layers, fused_mapping)``
   (``utils/quant_utils.py``): a fused prefix (``qkv_proj``) is mapped to its shards, which must
   agree ("some but not all shards ... are quantized" otherwise). SGLang
   ``Fp8Config.get_quant_method`` calls ``is_layer_skipped(prefix, ignored_layers)``
   (``srt/layers/quantization/utils.py``) without the mapping: it needs the fused name itself.
   So a kept ``q/k/v`` (``gate/up``) group is listed per projection and as ``qkv_proj``
   (``gate_up_proj``), and a group is kept or quantized as a whole.
4. **The MoE router is listed.** vLLM ``Qwen3MoeSparseMoeBlock`` (``models/qwen3_moe.py``) builds
   ``mlp.gate`` as a ``ReplicatedLinear`` with the quant config: unless listed it is an FP8 layer
   whose BF16 tensor is copied into FP8 storage with a scale never loaded (its default loader has
   no strict check for quantized models). Qwen's own FP8 releases list every ``mlp.gate``.
5. **Experts are FP8.** SGLang gives every ``FusedMoE`` the FP8 MoE method whatever
   ``ignored_layers`` says; vLLM skips a ``FusedMoE`` when any listed name holds its prefix. A MoE
   layer whose experts are kept in BF16 loads in vLLM and transformers only.

``plan`` applies them to the rollout's weights: what is written in FP8, what in BF16 (and
listed), and it refuses a weight that breaks rule 2 (or a fused group that breaks rule 3, or
BF16 experts) with an error naming the tensor, unless ``unservable="bf16"``: then such weights
are written in BF16 (the FP8 policy dequantized, ``values · scales``) and listed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

Unservable = Literal["error", "bf16"]
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SHARD = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp))\.(q|k|v|gate|up)_proj$")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.\w+_proj$")


class UnservableExportError(ValueError):
    """A block-FP8 export that vLLM, SGLang or transformers would load wrong or refuse."""


@dataclasses.dataclass(frozen=True)
class Linear:
    """One linear module of the export: its HF name, [N, K] shape and whether it is FP8."""

    module: str  # e.g. model.layers.0.self_attn.q_proj (no .weight)
    shape_NK: tuple[int, int]
    fp8: bool


def fused_name(module: str) -> str | None:
    """``...self_attn.q_proj`` -> ``...self_attn.qkv_proj``; ``...mlp.up_proj`` -> ``gate_up``."""
    m = _SHARD.match(module)
    if m is None:
        return None
    return f"{m.group(1)}.{'qkv_proj' if m.group(2) in 'qkv' else 'gate_up_proj'}"


def group_of(module: str) -> str:
    """The unit that is quantized as a whole: a fused module, one layer's experts, or itself."""
    m = _EXPERT.match(module)
    return m.group(1) if m else fused_name(module) or module


def partial_block(shape_NK: tuple[int, int], block: tuple[int, int]) -> str | None:
    """Why a weight of ``shape_NK`` cannot be written in ``block`` FP8 blocks, or None."""
    bad = [f"{ax}={n} % {b} != 0" for ax, n, b in zip("NK", shape_NK, block) if n % b]
    return ", ".join(bad) or None


def plan(
    linears: list[Linear], block: tuple[int, int], routers: list[str], unservable: Unservable
) -> tuple[set[str], list[str]]:
    """``(modules to write in BF16 although the rollout quantized them, ignored_layers)``."""
    if unservable not in ("error", "bf16"):
        raise ValueError(f"unservable must be 'error' or 'bf16', got {unservable!r}")
    reasons: dict[str, str] = {}
    for lin in linears:
        why = partial_block(lin.shape_NK, block) if lin.fp8 else None
        if why:
            reasons[lin.module] = f"{why} for the {block[0]}x{block[1]} blocks (partial block)"
    groups: dict[str, list[Linear]] = {}
    for lin in linears:
        groups.setdefault(group_of(lin.module), []).append(lin)
    for group, members in groups.items():
        bf16 = [m.module for m in members if not m.fp8 or m.module in reasons]
        if ".experts" in group and any(not m.fp8 for m in members):
            reasons.setdefault(members[0].module, "experts kept in BF16 (SGLang quantizes them)")
        elif bf16 and len(bf16) < len(members):
            for m in members:
                if m.fp8 and m.module not in reasons:
                    reasons[m.module] = f"{group} is fused with BF16 {bf16[0]}"
    if reasons and unservable == "error":
        listed = "; ".join(f"{m}: {r}" for m, r in sorted(reasons.items())[:6])
        raise UnservableExportError(
            f"the block-FP8 export would not load right in vLLM/SGLang/transformers: {listed}"
            + ("; ..." if len(reasons) > 6 else "")
            + ". Use a recipe whose weight blocks divide these sizes, or export with "
            "unservable='bf16' (--unservable=bf16) to write them in BF16 and list them"
        )
    demoted = set(reasons)
    for members in groups.values():  # a demoted shard or expert takes its group along
        if any(m.module in demoted for m in members):
            demoted |= {m.module for m in members if m.fp8}
    kept = {lin.module for lin in linears if not lin.fp8} | demoted
    return demoted, ignored_layers(kept, routers)


def ignored_layers(kept: set[str], routers: list[str]) -> list[str]:
    """Per-projection names, the fused names of whole kept groups, and the routers."""
    out = set(kept) | set(routers)
    for module in kept:
        fused = fused_name(module)
        if fused:
            prefix, name = fused.rsplit(".", 1)
            if all(f"{prefix}.{s}" in kept for s in FUSED[name]):
                out.add(fused)
    out.discard("lm_head")  # vLLM and SGLang never quantize lm_head
    return sorted(out)
