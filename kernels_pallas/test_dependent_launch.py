"""Dependent launch across the Mosaic GPU kernels (``kernels_pallas/dependent_launch.py``): the
compiled prologue of every decode and paged attention kernel (H100 SASS recorded by
``profile_gpu``) waits for its predecessor before any global memory access, the SASS reading
that says so, and the environment switch that turns it off. The decode GEMM's own prologue:
``fp8_matmul/test_dependent_launch.py``."""

import json

from kernels_pallas import dependent_launch
from kernels_pallas.fp8_matmul import mgpu_config
from kernels_pallas.perf_model import sass
from kernels_pallas.perf_model.sass_profiles import SASS_JSON


def test_attention_kernels_wait_before_their_first_access():
    """Every profiled attention kernel (dense and paged, swap-AB and unswapped, FP8 and BF16
    caches) waits once, before any global load or store; it prefetches nothing (the row's new
    slot was just written) and does not trigger its dependents."""
    with open(SASS_JSON) as f:
        variants = json.load(f)["variants"]
    names = [n for n in variants if n.startswith(("decode_", "paged_"))]
    assert len(names) >= 7, names
    want = dict(waits=1, prefetches=0, accesses_before_wait=0, triggers=0)
    for name in names:
        for kernel in variants[name]["kernels"]:
            assert kernel["dependent_launch"] == want, name


def test_sass_dependent_launch_flags_a_load_before_the_wait():
    text = """
        /*0100*/                   UTMAPF.L2.2D [UR4], [UR16] ;
        /*0110*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0120*/                   ACQBULK ;
        /*0130*/                   UTMALDG.2D [UR8], [UR6] ;
    """
    assert sass.dependent_launch(sass.parse_sass(text)) == dict(
        waits=1, prefetches=1, accesses_before_wait=1, triggers=0)  # fmt: skip
    assert sass.dependent_launch(sass.parse_sass(text.replace("ACQBULK", "NOP"))) is None


def test_the_environment_switch_launches_every_kernel_plainly(monkeypatch):
    monkeypatch.delenv(dependent_launch.ENV, raising=False)
    assert dependent_launch.enabled() and mgpu_config.default_config(16, 4096, 4096).pdl
    monkeypatch.setenv(dependent_launch.ENV, "0")
    assert not dependent_launch.enabled()
    assert not mgpu_config.default_config(16, 4096, 4096).pdl
    dependent_launch.dependent_launch(prefetch=[object()])  # nothing bound, nothing touched
