"""Where the host loop's arrays live: one device, or a mesh over devices and processes.

``make_placement`` picks ``SingleDevice`` (one device, one process: no shardings, so
``rl.build_programs`` jits each program plainly; host arrays moved with ``jnp.asarray``) or
``OnMesh`` (docs/SCALING.md §6: state sharded by ``train_state_shardings``, every program's
``sharding.program_shardings``, each process feeding and scoring only its own rows of every
batch). The trainer calls the same methods either way; no program is jitted here.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.generation import Prompts
from fp8rl_jax.rl import ProgramShardings
from fp8rl_jax.train import distributed as dist
from fp8rl_jax.train import sharding as sh


class SingleDevice:
    """One device, one process: no shardings; every method is the identity or a host copy."""

    is_main = True

    def activate(self):
        return contextlib.nullcontext()

    def restore_target(self, abstract_state):
        """Every leaf on this one device: a checkpoint a mesh saved restores here too (orbax
        needs a target sharding for arrays saved sharded)."""
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                            abstract_state)  # fmt: skip

    def place_state(self, state):
        return state

    def shardings(self, exp) -> ProgramShardings | None:
        """What ``rl.build_programs`` jits every program with (here: nothing, one device)."""
        del exp
        return None

    def rows(self, n_rows: int, group_size: int = 1) -> slice:
        """The rows of an [n_rows, ...] batch this process builds (here: all)."""
        del group_size
        return slice(0, n_rows)

    def prompts(self, tokens_BP: np.ndarray, lens_B: np.ndarray, n_rows: int) -> Prompts:
        """Device prompts of the global batch from this process's rows."""
        del n_rows
        return Prompts(jnp.asarray(tokens_BP), jnp.asarray(lens_B))

    def local_tokens(self, tokens_BT: jax.Array) -> np.ndarray:
        """This process's rows of a [B, T] device array, on the host."""
        return np.asarray(tokens_BT)

    def rewards(self, rewards_B: np.ndarray) -> jax.Array:
        """Device rewards of the global batch from this process's rows."""
        return jnp.asarray(rewards_B, jnp.float32)

    def mean_over_rows(self, local_mean: float, n_local: int, *, counts: bool = True) -> float:
        """The mean over all rows of a per-row quantity, from this process's mean of its rows
        (``counts``: a 0/1 quantity, whose per-process sums are rounded to exact counts)."""
        del n_local, counts
        return local_mean

    def all_rows(self, local_B: np.ndarray, n_rows: int, group_size: int) -> np.ndarray:
        """A per-row host vector of every process's rows, from this process's ``local_B``."""
        del n_rows, group_size
        return np.asarray(local_B)


class OnMesh(SingleDevice):
    """A mesh over all devices of all processes (SCALING.md §6)."""

    def __init__(self, mesh, model_cfg, abstract_state, prompt_len: int, batch_rows: int):
        self.mesh, self.model_cfg = mesh, model_cfg
        self.prompt_len, self.batch_rows = prompt_len, batch_rows
        self.state_sh = sh.train_state_shardings(abstract_state, model_cfg, mesh)
        self.abstract_state = abstract_state
        self.is_main = dist.is_main_process()

    def activate(self):
        return jax.set_mesh(self.mesh)

    def restore_target(self, abstract_state):
        return sh.abstract_with_shardings(abstract_state, self.state_sh)

    def place_state(self, state):
        """Puts a state that every process holds whole (same values) onto the mesh."""
        if jax.process_count() == 1:
            return jax.device_put(state, self.state_sh)
        return jax.tree.map(_from_every_process, state, self.state_sh)

    @functools.cache  # noqa: B019 (a few batch sizes per run)
    def _prompts_sh(self, n_rows: int) -> Prompts:
        return sh.batch_shardings(sh.abstract_prompts(n_rows, self.prompt_len), self.mesh)

    @functools.cache  # noqa: B019
    def _rows_sh(self, n_rows: int):
        return sh.rows_sharding(n_rows, self.mesh)

    def shardings(self, exp) -> ProgramShardings:
        """Every program's shardings on the mesh: the state as trained (FP8 weights pinned to
        their rollout layout, gathered once a step), batches split over rows."""
        rows = program_rows(exp)
        assert rows[0] == self.batch_rows, (rows, self.batch_rows)
        return sh.program_shardings(
            self.model_cfg, exp.rollout, exp.rl, self.mesh, self.abstract_state,
            self.prompt_len, rows,
        )  # fmt: skip

    def rows(self, n_rows: int, group_size: int = 1) -> slice:
        rows = dist.process_rows(self._prompts_sh(n_rows).tokens_BP, (n_rows, self.prompt_len))
        # Rewards are compared within a GRPO group, so no group may straddle two processes.
        assert rows.start % group_size == 0 and rows.stop % group_size == 0, (rows, group_size)
        return rows

    def prompts(self, tokens_BP, lens_B, n_rows: int) -> Prompts:
        return dist.global_batch(Prompts(tokens_BP, lens_B), self._prompts_sh(n_rows), n_rows)

    def local_tokens(self, tokens_BT):
        return dist.local_rows(tokens_BT)

    def rewards(self, rewards_B):
        rewards_B = np.asarray(rewards_B, np.float32)
        return dist.global_batch(rewards_B, self._rows_sh(self.batch_rows), self.batch_rows)

    def mean_over_rows(self, local_mean: float, n_local: int, *, counts: bool = True) -> float:
        if jax.process_count() == 1:
            return local_mean
        from jax.experimental import multihost_utils

        # Sums of exact per-row counts: every process gets the same float as one process would.
        sums = multihost_utils.process_allgather(np.array([local_mean * n_local, n_local]))
        total, rows = np.asarray(sums).reshape(-1, 2).sum(0)
        return (float(round(total)) if counts else float(total)) / float(rows)

    def all_rows(self, local_B, n_rows: int, group_size: int) -> np.ndarray:
        if jax.process_count() == 1:
            return np.asarray(local_B)
        from jax.experimental import multihost_utils

        rows = self.rows(n_rows, group_size)
        local = np.zeros((2, n_rows), np.float64)  # (values, held here)
        local[0, rows], local[1, rows] = np.asarray(local_B, np.float64), 1.0
        total = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 2, n_rows).sum(0)
        # a row held by several processes (replicas) has the same value on each
        return (total[0] / np.maximum(total[1], 1.0)).astype(np.asarray(local_B).dtype)


def program_rows(exp) -> tuple[int, int, int]:
    """Rows of ``exp``'s (step, DAPO generation, eval) batches; generation batches are the
    step's unless dynamic sampling asks for another size (``rl.dapo.gen_prompts``)."""
    Q, G, dapo = exp.trainer.prompts_per_step, exp.rl.group_size, exp.rl.dapo
    gen_rows = (dapo.gen_prompts or Q) * G if dapo.dynamic_sampling else Q * G
    return Q * G, gen_rows, exp.trainer.eval_size


def make_placement(exp, model_cfg, abstract_state, prompt_len: int):
    """``OnMesh`` when the mesh spans more than one device or process, else ``SingleDevice``."""
    if jax.device_count() == 1 and jax.process_count() == 1:
        return SingleDevice()
    mesh = sh.make_mesh(exp.mesh)
    return OnMesh(mesh, model_cfg, abstract_state, prompt_len, program_rows(exp)[0])


def _from_every_process(x, sharding):
    """A global array from a value every process holds whole (``device_put`` only takes
    shardings of this process's devices); typed PRNG keys travel as their key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _from_every_process(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=str(jax.random.key_impl(x)))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
