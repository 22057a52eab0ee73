"""Fake CPU devices for the scale-out workers, set before jax is imported (no jax import here).

The workers need their own device count, but not a fresh set of compiler flags: the test run's
LLVM level (conftest.py, ``--xla_backend_optimization_level=0``) and any user flag are kept, and
only an inherited device count is replaced, so the workers compile as fast as the test process.
"""

import os

_COUNT = "--xla_force_host_platform_device_count"


def use_fake_cpu_devices(n: int) -> None:
    """``n`` CPU devices for the jax imported after this call; other XLA_FLAGS are kept."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{_COUNT}={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
