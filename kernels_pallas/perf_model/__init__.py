"""A hardware-free performance model of the Pallas kernels (issue 21 item 1).

``common``: chips, cases, ``Prediction``, the table and its JSON/markdown; ``gpu``: Mosaic GPU
(H100/H200) predictions from the compiled kernels' SASS (``sass_profiles``: the profiles that
``profile_gpu`` writes, read back; ``gpu_grouped``: the BF16 MoE expert
kernels against XLA's dense ``ragged_dot``; ``gpu_targets``: the design changes before -> after
and issue 21's H100 targets; ``gpu_rollout``: a whole decode step, W8A8 + FP8 KV vs BF16);
``tile_report``: why ``fp8_matmul`` runs the Hopper tile it does at a shape (the dispatch ranks
tiles by ``gpu``: ``fp8_matmul.tile_choice``); ``tpu``: Mosaic TPU (v5e/v6e) predictions from
block shapes. ``python -m kernels_pallas.perf_model`` prints the table.
"""

from kernels_pallas.perf_model.common import CHIPS, Case, Chip, Prediction

__all__ = ["CHIPS", "Case", "Chip", "Prediction"]
