"""Shared pytest hooks: skip accelerator-marked tests where the accelerator is absent."""

import jax
import pytest


def _has_hopper() -> bool:
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return any(str(getattr(d, "compute_capability", "")).startswith("9") for d in devices)


def _has_tpu() -> bool:
    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    marked = [i for i in items if "gpu" in i.keywords or "tpu" in i.keywords]
    if not marked:
        return
    skips = {}
    if not _has_hopper():
        skips["gpu"] = pytest.mark.skip(
            reason="needs an NVIDIA Hopper GPU (compute capability 9.x)"
        )
    if not _has_tpu():
        skips["tpu"] = pytest.mark.skip(reason="needs a TPU")
    for item in marked:
        for name, mark in skips.items():
            if name in item.keywords:
                item.add_marker(mark)
