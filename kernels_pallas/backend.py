"""What ``impl="auto"`` picks on this machine; shared by every kernel's dispatcher."""

from typing import Literal

import jax

Impl = Literal["auto", "xla", "pallas_mosaic_gpu", "pallas_tpu"]
IMPLS = ("auto", "xla", "pallas_mosaic_gpu", "pallas_tpu")


def default_impl() -> str:
    """auto: Mosaic GPU on Hopper (sm_90), Mosaic TPU on TPU, the jnp reference elsewhere."""
    dev = jax.devices()[0]
    if dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9"):
        return "pallas_mosaic_gpu"
    if dev.platform == "tpu":
        return "pallas_tpu"
    return "xla"
