"""DAPO dynamic sampling on the host: generation batches until the step's batch is full.

Each RL step needs ``Q = prompts_per_step`` groups of ``G`` responses. With
``rl.dapo.dynamic_sampling`` the loop generates batches of the same ``Q x G`` shape (the one
compiled rollout program), scores them on the host, and keeps the groups whose rewards are not
all equal (``rl.dapo.informative_groups``; an all-equal group has zero GRPO advantage) in a
fixed-size buffer, until ``Q`` groups are kept or ``max_num_gen_batches`` batches were generated.
Slots still empty then hold a filtered group of the first batch with ``keep_BT = 0``: they leave
the loss, and the train program still sees the same shapes (``rl.dapo.select_rows``, jitted
once), so nothing recompiles between steps.

Data: generation batch ``k`` of step ``t`` reads problems ``(t·M + k)·Q ..`` with
``M = max_num_gen_batches``, so a step's data depends only on ``t`` (resumes reproduce a run);
batches a step does not need are skipped. Sampling keys: batch ``k > 0`` folds ``k`` into the
state's key, so its responses are drawn independently of batch 0's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from fp8rl_jax.rl.dapo import informative_groups, select_rows


class Sampled(NamedTuple):
    """A step's rollout batch as the train program takes it, and what the host measured."""

    batch: object  # rl.RolloutBatch, [Q·G] rows
    rewards_B: np.ndarray  # float32 host rewards of its rows (this process's rows)
    accuracy: float  # exact accuracy over every response generated this step
    rollout_time_s: float  # the host's wait for the rollouts' tokens
    metrics: dict  # host metrics to log beside the rollout's device metrics


@dataclasses.dataclass
class _Buffer:
    """Which generated rows fill the step's Q group slots so far."""

    take_B: np.ndarray  # int32 [B]: row of the current generation batch for each slot, or -1
    valid_B: np.ndarray  # float32 [B]: 1 on filled slots
    rewards_B: np.ndarray  # float32 [B]: the host rewards of the rows in the slots
    filled: int = 0  # slots (groups) filled


def make_dynamic_sampler(run, rollout_step: Callable, prompts_of: Callable, score: Callable):
    """``sample(state, step, on_dispatch) -> Sampled`` for ``run`` (a ``trainer._Run``).

    ``prompts_of(i) -> (prompt batch, device prompts)``: generation batch ``i`` of the run;
    ``score(batch, tokens_BT) -> (rewards_B, accuracy)`` rewards the host tokens of a prompt
    batch; ``on_dispatch()`` runs once, after the step's first rollout is dispatched and the
    previous update has finished (the trainer reads the previous step's metrics there).
    """
    from fp8rl_jax.train.placement import SingleDevice

    if type(run.placement) is not SingleDevice:
        raise NotImplementedError(
            "rl.dapo.dynamic_sampling runs on one device for now (the row selection is not "
            "sharded); use a one-device run or set rl.dapo.dynamic_sampling=False"
        )
    dapo, Q, G = run.exp.rl.dapo, run.exp.trainer.prompts_per_step, run.exp.rl.group_size
    merge = jax.jit(select_rows)

    def sample(state, step: int, on_dispatch: Callable[[], None]) -> Sampled:
        buf = _Buffer(np.full(Q * G, -1, np.int32), np.zeros(Q * G, np.float32),
                      np.zeros(Q * G, np.float32))  # fmt: skip
        merged, wait, correct, n_rows, filtered = None, 0.0, 0.0, 0, 0
        for k in range(dapo.max_num_gen_batches):
            batch, prompts = prompts_of(step * dapo.max_num_gen_batches + k)
            key = state.rng if k == 0 else jax.random.fold_in(state.rng, k)
            ro = rollout_step(dataclasses.replace(state, rng=key), prompts)
            if k == 0:
                jax.block_until_ready(state.step)
                on_dispatch()
            t0 = time.perf_counter()
            tokens = run.placement.local_tokens(ro.tokens_BT)
            wait += time.perf_counter() - t0
            rewards, acc = score(batch, tokens)
            correct, n_rows = correct + acc * len(rewards), n_rows + len(rewards)
            keep_Q = informative_groups(rewards, G)
            filtered += int(np.sum(~keep_Q))
            if k == 0:  # empty slots hold batch 0's rows (masked) unless filled later
                buf.rewards_B[:] = rewards
            buf.take_B[:] = -1
            for q in np.flatnonzero(keep_Q)[: Q - buf.filled]:
                slots = slice(buf.filled * G, (buf.filled + 1) * G)
                buf.take_B[slots] = np.arange(q * G, (q + 1) * G)
                buf.valid_B[slots] = 1.0
                buf.rewards_B[slots] = rewards[q * G : (q + 1) * G]
                buf.filled += 1
            merged = merge(ro if merged is None else merged, ro, buf.take_B, buf.valid_B)
            if buf.filled == Q:
                break
        metrics = {
            "dapo_gen_batches": float(k + 1),
            "dapo_groups_filtered": float(filtered),
            "dapo_groups_kept": float(buf.filled),
            "dapo_unfilled_frac": 1.0 - buf.filled / Q,
        }
        return Sampled(merged, buf.rewards_B.copy(), correct / n_rows, wait, metrics)

    return sample
