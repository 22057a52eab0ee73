"""Programmatic dependent launch (PDL, sm_90+) for the Mosaic GPU kernels.

A kernel that waits with ``griddepcontrol.wait`` before its first read of anything its
predecessor in the stream may write is launched with programmatic stream serialization (Pallas
sets the launch attribute when a kernel binds ``plgpu.griddepcontrol_wait``: the module's
``mosaic_gpu.uses_pdl``). Its grid then starts as soon as every CTA of the predecessor has
exited (or triggered with ``griddepcontrol.launch_dependents``, which none of our predecessors
do: XLA's fusions and the Triton quantization kernels), not once the predecessor has completed
and flushed: its launch, CTA setup and barrier initialisation run under the predecessor's
drain. Before the wait it may touch only what no earlier kernel writes: the decode
GEMM prefetches its first ring of weight tiles into L2 (a hint: every byte it reads is read
again, after the wait, through the coherent L2), as CUTLASS's Hopper GEMM with weight prefetch
does (``media/docs/dependent_kernel_launch.md``: "one of the input matrices (our weights) will
not be produced by a prior kernel"). The kernels do not trigger their own dependents early:
a dependent GEMM started under a running one would hold its SMs idle at the wait, and CUPTI
would count that wait in its kernel time (the benchmarks' and the autotuner's timer).

Semantics are unchanged: every operand read and every store happens after the wait, which
returns once the predecessor has completed and its memory is visible. GPU interpret mode has no
grid dependency (one kernel at a time), so ``interpret=True`` leaves all of it out.

Who launches dependent: the decode fp8_matmul tiles (``MgpuConfig.pdl``, their default) with
their weight prefetch, and the decode and paged attention kernels (no prefetch: the cache row
they read was just written). ``FP8RL_PDL=0`` in the environment (read when a kernel is traced)
launches every kernel plainly: a switch for a driver or runtime that mishandles the launch
attribute, and for measuring a whole program both ways.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

ENV = "FP8RL_PDL"


def enabled() -> bool:
    """Whether kernels may launch dependent (``FP8RL_PDL`` unset or not "0")."""
    return os.environ.get(ENV, "1") != "0"


def _forced_interpret() -> bool:
    """Whether ``plgpu.force_gpu_interpret_mode`` (or ``set_gpu_interpret_mode``) interprets every
    kernel traced now, whatever its ``interpret`` argument (jax's private switch, on jax 0.11.2
    and 0.12 alike)."""
    from jax._src import config

    flag = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
    return flag is not None and flag.value is not None


def dependent_launch(prefetch: Sequence = (), *, leader: tuple[str, int] | None = None,
                     interpret: bool = False) -> None:  # fmt: skip
    """At a kernel's start: prefetch ``prefetch`` (GMEM refs no earlier kernel writes, each a
    legal TMA box: <= 256 elements a dimension) into L2 from the thread ``leader`` = (axis name,
    index) names (every thread if None), then wait for the predecessor. Nothing under
    ``interpret`` (or a forced interpret mode) or with ``FP8RL_PDL=0``."""
    if interpret or _forced_interpret() or not enabled():
        return
    from jax import lax  # here: the switch above is read by pure-Python config code too
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if prefetch:

        def issue():
            for ref in prefetch:
                plgpu.async_prefetch(ref)

        if leader is None:
            issue()
        else:
            pl.when(lax.axis_index(leader[0]) == leader[1])(issue)
    plgpu.griddepcontrol_wait()
