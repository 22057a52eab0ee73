"""DAPO dynamic sampling on the host: generation batches until the step's batch is full.

Each RL step trains on ``Q = trainer.prompts_per_step`` groups of ``G`` responses. With
``rl.dapo.dynamic_sampling`` the loop generates batches of ``Q_gen = rl.dapo.gen_prompts``
prompts (default ``Q``; the paper's recipe oversamples 3x) x ``G`` responses, always the same
shape (one compiled rollout program), scores them on the host, and keeps the groups whose rewards
are not all equal (``rl.dapo.informative_groups``: an all-equal group has zero GRPO advantage),
first come first kept, until ``Q`` groups are kept or ``max_num_gen_batches`` batches were
generated. Slots still empty then hold filtered groups of the first batch with ``keep_BT = 0``:
they leave the loss, and the train program still sees the same shapes (``rl.dapo.select_rows``,
the ``select_rows`` program of ``rl.build_programs``), so nothing recompiles between steps.

Data: generation batch ``k`` of step ``t`` reads problems ``(t·M + k)·Q_gen ..`` with
``M = max_num_gen_batches``, so a step's data depends only on ``t`` (a resumed run reproduces an
uninterrupted one); batches a step does not need are skipped. Sampling keys: batch ``k > 0``
folds ``k`` into the state's key, so its responses are drawn independently of batch 0's.

On a mesh (``train.placement.OnMesh``, one or several processes) each process generates and
scores its own rows, the rewards are gathered, and every process makes the same selection; the
generation batch has its own rollout program (``Programs.gen_rollout``, its row count) and the
selection writes the train program's batch layout, so the same numbers come out as on one device
(tested).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from fp8rl_jax.rl import Programs
from fp8rl_jax.rl.dapo import DAPOConfig, informative_groups
from fp8rl_jax.tasks import PromptBatch
from fp8rl_jax.train.placement import SingleDevice


class Sampled(NamedTuple):
    """A step's rollout batch as the train program takes it, and what the host measured."""

    batch: object  # rl.RolloutBatch, [Q·G] rows
    rewards_B: np.ndarray  # float32 host rewards of this process's rows of it
    accuracy: float  # exact accuracy over every response generated this step
    rollout_time_s: float  # the host's wait for the rollouts' tokens
    metrics: dict  # host metrics to log beside the rollout's device metrics


@dataclasses.dataclass
class _Slots:
    """Which generated rows fill the step's Q group slots so far."""

    take_B: np.ndarray  # int32 [Q·G]: row of the current generation batch for each slot, or -1
    valid_B: np.ndarray  # float32 [Q·G]: 1 on filled slots
    rewards_B: np.ndarray  # float32 [Q·G]: the host rewards of the rows in the slots
    filled: int = 0  # group slots filled

    def assign(self, groups, rewards: np.ndarray, G: int, valid: bool) -> None:
        """Puts ``groups`` (indices into the generation batch) into the next free slots; only
        ``valid`` ones count as filled (others are placeholders the next groups overwrite)."""
        for j, q in enumerate(groups):
            s = self.filled + j
            slot, rows = slice(s * G, (s + 1) * G), np.arange(q * G, (q + 1) * G)
            self.take_B[slot], self.rewards_B[slot] = rows, rewards[rows]
            self.valid_B[slot] = float(valid)
        self.filled += len(groups) if valid else 0


def make_dynamic_sampler(
    dapo: DAPOConfig,
    Q: int,
    G: int,
    programs: Programs,
    place: SingleDevice,
    prompt_batch: Callable[[range], PromptBatch],
    score: Callable[[PromptBatch, np.ndarray], tuple[np.ndarray, float]],
):
    """``sample(state, step, on_dispatch) -> Sampled``: DAPO's batches of ``Q`` groups of ``G``.

    ``programs``: the run's programs (``gen_rollout``, ``select_rows``, ``fold_key``);
    ``place``: where the rows live (``train.placement``); ``prompt_batch(problems)``: the host
    prompt batch of those problem indices, ``G`` rows each; ``score(batch, tokens_BT) ->
    (rewards_B, accuracy)`` rewards the host tokens of a prompt batch. ``on_dispatch()`` runs
    once, after the step's first rollout is dispatched and the previous update has finished
    (the trainer reads the previous step's metrics there). On a mesh every process scores its
    own rows; the group filter runs on the gathered rewards, so every process selects the same
    rows.
    """
    Q_gen, M = dapo.gen_prompts or Q, dapo.max_num_gen_batches
    if Q_gen < Q:
        raise ValueError(f"rl.dapo.gen_prompts ({Q_gen}) must be >= prompts_per_step ({Q})")
    train_rows = place.rows(Q * G, G)

    def prompts_of(i: int):
        rows = place.rows(Q_gen * G, G)  # this process's groups only
        batch = prompt_batch(range(i * Q_gen + rows.start // G, i * Q_gen + rows.stop // G))
        return batch, place.prompts(batch.tokens_BP, batch.lens_B, Q_gen * G)

    def sample(state, step: int, on_dispatch: Callable[[], None]) -> Sampled:
        slots = _Slots(np.full(Q * G, -1, np.int32), np.zeros(Q * G, np.float32),
                       np.zeros(Q * G, np.float32))  # fmt: skip
        merged, wait, correct, filtered = None, 0.0, 0.0, 0
        for k in range(M):
            batch, prompts = prompts_of(step * M + k)
            key = state.rng if k == 0 else programs.fold_key(state.rng, np.uint32(k))
            ro = programs.gen_rollout(dataclasses.replace(state, rng=key), prompts)
            if k == 0:
                jax.block_until_ready(state.step)
                on_dispatch()
            t0 = time.perf_counter()
            tokens = place.local_tokens(ro.tokens_BT)
            wait += time.perf_counter() - t0
            local_rewards, acc = score(batch, tokens)
            correct += place.mean_over_rows(float(acc), len(local_rewards)) * Q_gen * G
            rewards = place.all_rows(local_rewards, Q_gen * G, G)
            keep_Q = informative_groups(rewards, G)
            filtered += int(np.sum(~keep_Q))
            slots.take_B[:] = -1
            slots.assign(np.flatnonzero(keep_Q)[: Q - slots.filled], rewards, G, valid=True)
            if k == 0:  # the other slots get filtered groups of batch 0, masked until filled
                slots.assign(np.flatnonzero(~keep_Q)[: Q - slots.filled], rewards, G, valid=False)
            merged = programs.select_rows(merged, ro, slots.take_B, slots.valid_B)
            if slots.filled == Q:
                break
        metrics = {
            "dapo_gen_batches": float(k + 1),
            "dapo_groups_filtered": float(filtered),
            "dapo_groups_kept": float(slots.filled),
            "dapo_unfilled_frac": 1.0 - slots.filled / Q,
        }
        accuracy = correct / ((k + 1) * Q_gen * G)
        return Sampled(merged, slots.rewards_B[train_rows].copy(), accuracy, wait, metrics)

    return sample
