"""``grouped_matmul``: the MoE experts' BF16 grouped GEMM ``y_m = x_m · w[e(m)]``, differentiable.

Implementations (``backend.ImplTable``; ``impl="auto"`` takes the Hopper kernels when their support
check passes, else ``xla``; an explicit impl that cannot run raises):
  * ``xla``: ``jax.lax.ragged_dot`` (``reference.grouped_matmul_reference``) and its autodiff.
    Native on TPU; on GPU XLA expands it densely over the groups (``pallas_mosaic_gpu.py``).
  * ``pallas_mosaic_gpu``: ``gmm_mgpu`` forward, and a custom VJP whose input gradient is
    ``gmm_mgpu`` against the transposed stacks and whose weight gradient is ``tgmm_mgpu``: only
    the live rows are computed, forward and backward. With ``FP8RL_AUTOTUNE=1`` on a Hopper GPU,
    ``impl="auto"`` and no config, each pass runs the tile tuned for its shape (``tuning``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.backend import Implementation, ImplTable, device_reason
from kernels_pallas.grouped_matmul import pallas_mosaic_gpu as mgpu
from kernels_pallas.grouped_matmul import tuning
from kernels_pallas.grouped_matmul.reference import grouped_matmul_reference


def operand_error(x_MK, w_EKN, group_sizes_E) -> str | None:
    """Why these operands are not a grouped matmul, or None."""
    if x_MK.ndim != 2 or w_EKN.ndim != 3:
        return f"x must be [M, K] and w [E, K, N], got {x_MK.shape} and {w_EKN.shape}"
    if x_MK.shape[1] != w_EKN.shape[1]:
        return f"x's K={x_MK.shape[1]} differs from w's K={w_EKN.shape[1]} (w is [E, K, N])"
    if group_sizes_E.shape != (w_EKN.shape[0],):
        return f"group_sizes must be [E={w_EKN.shape[0]}], got {group_sizes_E.shape}"
    if not jnp.issubdtype(group_sizes_E.dtype, jnp.integer):
        return f"group_sizes must be integers, got {group_sizes_E.dtype}"
    return None


def _mgpu_supports(x, w, gs, *, config, interpret) -> str | None:
    del gs
    if config is not None and not isinstance(config, mgpu.GmmConfig):
        return f"config is a {type(config).__name__}, not a GmmConfig"
    if (reason := device_reason("gpu", interpret)) is not None:
        return reason
    if x.dtype != w.dtype:
        return f"x ({x.dtype}) and w ({w.dtype}) must share a dtype"
    (m, k), n = x.shape, w.shape[2]
    return mgpu.supports(m, k, n, w.dtype, config)


def _run_xla(x, w, gs, *, config, interpret):
    del config, interpret
    return grouped_matmul_reference(x, w, gs)


def _pass_config(config, tune: bool, tuned, *args, **kw):
    """The pass's tile: ``config``, else with ``tune`` the tuner's choice (``tuned``: a
    ``tuning.tuned_*``, timing ``run`` on first use), else None (the pass's default)."""
    if config is not None or not tune:
        return config
    return tuned(*args, **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(x, w, gs, config, interpret, tune):
    cfg = _pass_config(config, tune, tuning.tuned_gmm, x, w, gs, transpose_w=False,
                       out_dtype=x.dtype, run=mgpu.gmm_mgpu)  # fmt: skip
    return mgpu.gmm_mgpu(x, w, gs, config=cfg, interpret=interpret)


def _gmm_fwd(x, w, gs, config, interpret, tune):
    return _gmm(x, w, gs, config, interpret, tune), (x, w, gs)


def _varying(a) -> frozenset:
    """The manual mesh axes ``a`` varies over (``.vma`` in older jax)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def _like(ct, primal):
    """``ct`` typed as varying over the manual mesh axes ``primal`` varies over (inside a
    ``shard_map`` a custom VJP's cotangents must carry their primals' types; a Pallas call's
    output may carry fewer)."""
    missing = _varying(primal) - _varying(ct)
    return jax.lax.pcast(ct, tuple(sorted(missing)), to="varying") if missing else ct


def _gmm_bwd(config, interpret, tune, res, dy):
    x, w, gs = res
    dy = dy.astype(x.dtype)
    # dx = dy · w[e]ᵀ: w [E, K, N] is read in place as the transposed kernel's [E, N_out, K_c].
    cfg = _pass_config(config, tune, tuning.tuned_gmm, dy, w, gs, transpose_w=True,
                       out_dtype=x.dtype, run=mgpu.gmm_mgpu)  # fmt: skip
    dx = mgpu.gmm_mgpu(dy, w, gs, transpose_w=True, out_dtype=x.dtype, config=cfg,
                       interpret=interpret)  # fmt: skip
    cfg = _pass_config(config, tune, tuning.tuned_tgmm, x, dy, gs, out_dtype=w.dtype,
                       run=mgpu.tgmm_mgpu)  # fmt: skip
    dw = mgpu.tgmm_mgpu(x, dy, gs, out_dtype=w.dtype, config=cfg, interpret=interpret)
    return _like(dx, x), _like(dw, w), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _run_mgpu(x, w, gs, *, config, interpret, tune: bool = False):
    return _gmm(x, w, gs, config, interpret, tune)


IMPLEMENTATIONS = ImplTable(
    "grouped_matmul",
    [
        Implementation("xla", _run_xla),
        Implementation("pallas_mosaic_gpu", _run_mgpu, _mgpu_supports),
    ],
)


def grouped_matmul(
    x_MK: jax.Array,
    w_EKN: jax.Array,
    group_sizes_E: jax.Array,
    *,
    impl: str = "auto",
    config=None,
    interpret: bool = False,
) -> jax.Array:
    """Rows ``x [M, K]`` sorted by group times their group's weight ``w [E, K, N]``: ``[M, N]`` in
    x's dtype (f32 accumulation), rows past ``Σ group_sizes`` zero; differentiable in x and w.

    ``x`` is cast to w's dtype first (as ``experts._ragged`` always did). ``impl``: "auto" |
    "xla" | "pallas_mosaic_gpu"; ``config``: a ``GmmConfig`` for the Hopper kernels' three
    passes (None: each pass its default, or with ``FP8RL_AUTOTUNE=1`` on a Hopper GPU and
    ``impl="auto"`` its tile tuned there: ``tuning``).
    """
    if (err := operand_error(x_MK, w_EKN, group_sizes_E)) is not None:
        raise ValueError(f"grouped_matmul: {err}")
    x = x_MK.astype(w_EKN.dtype)
    chosen = IMPLEMENTATIONS.select(impl, x, w_EKN, group_sizes_E, config=config,
                                    interpret=interpret)  # fmt: skip
    kw = {}
    if chosen.name == "pallas_mosaic_gpu" and tuning.enabled_for(impl, config, interpret):
        kw["tune"] = True
    return chosen.run(x, w_EKN, group_sizes_E, config=config, interpret=interpret, **kw).astype(
        x_MK.dtype
    )
