"""Shared pytest hooks: one persistent compilation cache per test run; accelerator skips.

The cache: the process that starts the run (the xdist controller, or pytest alone) makes one
directory and exports it as ``JAX_COMPILATION_CACHE_DIR``, with no minimum compile time or entry
size, before jax is imported. xdist workers and every test subprocess (trainer runs, sharding
and multi-process workers, the notebook kernel) inherit the environment, so a program compiled
by one of them is loaded, not compiled, by the others. The directory is removed when the run
ends. A ``JAX_COMPILATION_CACHE_DIR`` set by the user is used as is and kept. A second directory,
``FP8RL_TEST_SHARED_DIR``, made and removed the same way, holds outputs that several test files
read (``testing.shared_once``), made once by whichever worker asks first.

Compile time, not run time, dominates the suite's tiny models, so the run's processes compile
with LLVM at -O0 (``--xla_backend_optimization_level=0``, appended to ``XLA_FLAGS`` unless the
user set a level): it changes code generation only, not the HLO or IEEE semantics (XLA:CPU does
not enable fast math). Measured on tests/test_rollout.py, cold cache, the two runs side by side
on one 2-core machine under load ~30: 791 s at -O0 vs 1027 s at the default -O3 (its first,
compile-bound test 390 s vs 594 s). The same variable carries
``kernels_pallas.backend.GPU_INTERPRET_XLA_FLAG`` (XLA:CPU's sequential thunk schedule), without
which a Mosaic GPU kernel interpreted on CPU can hang the pool its barrier callbacks run on.
A test still running after pyproject's ``timeout`` (pytest-timeout) fails with every thread's
stack instead of holding CI to its limit.
"""

import os
import shutil
import tempfile

import pytest

_RUN_CACHE = "FP8RL_TEST_COMPILATION_CACHE"  # set by the process that owns the run's cache
_OWNED: str | None = None
if _RUN_CACHE not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWNED = os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="fp8rl_jax_xla_cache_")
# Outputs made once per test run and read by several test files on any xdist worker
# (testing.shared_once: the trainer's reference run).
_RUN_SHARED = "FP8RL_TEST_SHARED_DIR"
_OWNED_SHARED: str | None = None
if _RUN_SHARED not in os.environ:
    _OWNED_SHARED = os.environ[_RUN_SHARED] = tempfile.mkdtemp(prefix="fp8rl_jax_shared_")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
if _RUN_CACHE in os.environ:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_RUN_CACHE])
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Mosaic GPU kernels interpreted on CPU can hang XLA:CPU's thread pool unless one scheduler flag
# is set before the first computation (``backend.GPU_INTERPRET_XLA_FLAG`` says why); imported
# here, after the cache variables above, which jax reads when it is imported.
from kernels_pallas.backend import prepare_gpu_interpret  # noqa: E402

prepare_gpu_interpret()


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        for owned in (_OWNED, _OWNED_SHARED):
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)


def _has_hopper() -> bool:
    import jax

    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return any(str(getattr(d, "compute_capability", "")).startswith("9") for d in devices)


def _has_tpu() -> bool:
    import jax

    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


# The test files that take longest, heaviest first (seconds per file on 2 idle CPU cores, cold
# compile cache, `--durations=0` of the full run at the commit that last changed this list:
# reliability 108, trainer_sharded 85, ..., paged_rl_step 15; the other ~50 files take less).
# xdist's ``--dist loadfile`` hands files to the workers in collection order, and by default
# re-sorts them by test count, which sent the files of two or three slow end-to-end tests last:
# one worker ran them for minutes while the other sat idle. Here the run starts with the
# heaviest files (longest-processing-time-first scheduling) and the rest follow in their usual
# order, so the two workers finish together. A stale order costs wall time, never a result.
HEAVY_FILES = (
    "tests/test_reliability.py",
    "tests/test_trainer_sharded.py",
    "kernels_pallas/fp8_matmul/test_fp8_matmul.py",
    "tests/test_sharding_mesh.py",
    "tests/test_chunked_logprobs.py",
    "tests/test_train_dapo.py",
    "tests/test_train_hf.py",
    "tests/test_fused_projections.py",
    "tests/test_train_precision.py",
    "kernels_pallas/fp8_train_matmul/test_fp8_train_matmul.py",
    "tests/test_models.py",
    "tests/test_notebook.py",
    "tests/test_generation.py",
    "kernels_pallas/decode_attention/test_decode_attention.py",
    "tests/test_paged_engine.py",
    "tests/test_trainer.py",
    "kernels_pallas/grouped_fp8_matmul/test_grouped_fp8_matmul.py",
    "tests/test_repro_long.py",
    "tests/test_router_replay.py",
    "kernels_pallas/act_quantize/test_fused.py",
    "tests/test_rl_step.py",
    "tests/test_models_moe.py",
    "tests/test_rl_step_ppo.py",
    "tests/test_paged_sharded.py",
    "kernels_pallas/grouped_matmul/test_grouped_matmul.py",
    "tests/test_paged_rl_step.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


def _heaviest_files_first(items) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(it.nodeid.split("::")[0], len(rank)), order[id(it)]))


def pytest_collection_modifyitems(config, items):
    _heaviest_files_first(items)
    # Markers, not keywords: keywords also hold directory names (a checkout in .../tpu/).
    marked = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("tpu")]
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
            if item.get_closest_marker(name):
                item.add_marker(mark)
