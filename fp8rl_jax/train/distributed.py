"""Multi-host runs: ``jax.distributed`` start-up, per-process data, process-0 logging.

One process per host (or per GPU) runs the same program on its slice of a global batch. The
coordinator address, process count and process id come from ``DistributedConfig``, else from
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, else from SLURM
(``SLURM_NTASKS``, ``SLURM_PROCID``, the first host of ``SLURM_JOB_NODELIST`` and
``JAX_COORDINATOR_PORT``). ``maybe_initialize_distributed`` must run before any other jax call.

Data: the host loop builds only the rows its devices hold (``process_rows``), and
``global_batch`` assembles them into global arrays with ``jax.make_array_from_process_local_data``.
Host-side rewards work the same way on ``local_rows`` of the generated tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections.abc import Callable, Mapping

import jax
import numpy as np

log = logging.getLogger(__name__)

DEFAULT_PORT = 12355
_state = {"initialized": False}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator is and who this process is; empty fields come from the environment."""

    coordinator_address: str = ""  # "host:port" of process 0; "" = JAX_* or SLURM environment
    num_processes: int = 0  # 0 = from the environment (1 if none is set)
    process_id: int = -1  # -1 = from the environment
    local_device_ids: tuple[int, ...] = ()  # accelerators of this process; () = all visible
    cpu_collectives: str = "gloo"  # CPU cross-process collectives (tests, CPU clusters)
    initialization_timeout_s: int = 300  # how long to wait for all processes to connect


def _first_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist: 'gpu[003-005,007],cpu1' -> 'gpu003'."""
    first = re.match(r"[^,\[]+(\[[^\]]*\])?", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse SLURM nodelist {nodelist!r}")
    host = first.group(0)
    if "[" in host:
        prefix, ranges = host.split("[", 1)
        host = prefix + re.split(r"[-,\]]", ranges)[0]
    return host


def resolve(cfg: DistributedConfig, env: Mapping[str, str] = os.environ) -> dict | None:
    """``jax.distributed.initialize`` kwargs, or None for a single-process run."""
    n = cfg.num_processes or int(env.get("JAX_NUM_PROCESSES", 0) or env.get("SLURM_NTASKS", 1))
    if n <= 1:
        return None
    pid = cfg.process_id
    if pid < 0:
        pid_env = env.get("JAX_PROCESS_ID", env.get("SLURM_PROCID"))
        if pid_env is None:
            raise ValueError(
                f"{n} processes but no process id: set DistributedConfig.process_id, "
                "JAX_PROCESS_ID or run under srun (SLURM_PROCID)"
            )
        pid = int(pid_env)
    addr = cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "")
    if not addr:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodes:
            raise ValueError(
                f"{n} processes but no coordinator: set DistributedConfig.coordinator_address "
                "or JAX_COORDINATOR_ADDRESS=host:port (or run under SLURM)"
            )
        addr = f"{_first_host(nodes)}:{env.get('JAX_COORDINATOR_PORT', DEFAULT_PORT)}"
    if not 0 <= pid < n:
        raise ValueError(f"process id {pid} is outside 0..{n - 1}")
    kwargs = dict(coordinator_address=addr, num_processes=n, process_id=pid,
                  initialization_timeout=cfg.initialization_timeout_s)  # fmt: skip
    if cfg.local_device_ids:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    return kwargs


def maybe_initialize_distributed(cfg: DistributedConfig = DistributedConfig()) -> bool:
    """Starts ``jax.distributed`` when more than one process is configured; True if it did.

    Call it first thing in the entry point (before any jax computation or device query).
    Idempotent. CPU runs use ``cfg.cpu_collectives`` (gloo) for cross-process collectives.
    """
    if _state["initialized"]:
        return True
    kwargs = resolve(cfg)
    if kwargs is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    log.info("jax.distributed.initialize(%s)", kwargs)
    jax.distributed.initialize(**kwargs)
    _state["initialized"] = True
    return True


def is_main_process() -> bool:
    return jax.process_index() == 0


def main_process_only(fn: Callable) -> Callable:
    """Wraps ``fn`` (e.g. ``MetricsLogger.log``) to run on process 0 only (None elsewhere)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if is_main_process() else None

    return wrapper


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous rows (axis 0) of a global array that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    rows = set()
    for idx in index_map.values():
        r = idx[0] if idx else slice(None)
        rows.update(range(*r.indices(global_shape[0])))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError(
            f"this process holds non-contiguous rows of a {global_shape} array under {sharding}; "
            "order the mesh so the batch axes follow the process order (data outermost)"
        )
    return slice(lo, hi)


def global_batch(local_tree, shardings, global_rows: int):
    """Global arrays from this process's rows (``process_rows``) of every [B, ...] leaf.

    Replicated leaves (scalars, per-layer stats) must be the full value on every process.
    """

    def one(x, s):
        x = np.asarray(x)
        if s.is_fully_replicated or x.ndim == 0:
            return jax.make_array_from_process_local_data(s, x, x.shape)
        return jax.make_array_from_process_local_data(s, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(one, local_tree, shardings)


def local_rows(x: jax.Array) -> np.ndarray:
    """The rows of a [B, ...] global array held by this process, as numpy (replicas dropped)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = {}
    for s in x.addressable_shards:
        start = (s.index[0].start or 0) if s.index else 0
        shards.setdefault(start, np.asarray(s.data))
    return np.concatenate([shards[k] for k in sorted(shards)], axis=0)


def gather_to_host(tree):
    """Every leaf as a full numpy array on every process (tests, evaluation; not hot loops)."""
    from jax.experimental import multihost_utils

    return jax.tree.map(
        lambda x: (
            np.asarray(x)
            if x.is_fully_addressable or x.is_fully_replicated
            else np.asarray(multihost_utils.process_allgather(x, tiled=True))
        ),
        tree,
    )


def sync(name: str) -> None:
    """Barrier across processes (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def broadcast_text(text: str, max_bytes: int = 2048) -> str:
    """Process 0's ``text`` on every process (itself with one process); UTF-8, cut to max_bytes."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    data = text.encode("utf-8")[:max_bytes]
    buf = np.zeros(max_bytes + 4, np.uint8)
    buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
    buf[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    n = int(np.frombuffer(out[:4].tobytes(), np.uint32)[0])
    return out[4 : 4 + n].tobytes().decode("utf-8", errors="replace")


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is True on any process (a host all-gather; no-op with one process)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(flag)]))).any())
