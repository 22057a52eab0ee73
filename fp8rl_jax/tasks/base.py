"""The verifiable-task interface: examples, grades, rewards, and a hash-based train/eval split."""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: the prompt text, its reference answer, and task data for the verifier."""

    prompt: str  # text the policy continues, e.g. "12+34="
    answer: str  # reference final answer, e.g. "46"
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # verifier inputs


@dataclasses.dataclass(frozen=True)
class Grade:
    """What a verifier found in one completion."""

    correct: bool  # the final answer is right
    well_formed: bool  # the completion has the expected answer format


class Task(abc.ABC):
    """A source of examples with a string verifier.

    `sample(index, split)` is a pure function of (task config, split, index), so a run resumes
    from a saved data position alone. `reward` is 1.0 for a correct answer, `format_reward` for a
    well-formed wrong one, 0.0 otherwise.
    """

    name: str
    format_reward: float

    @abc.abstractmethod
    def sample(self, index: int, split: Split = "train") -> Example:
        """The example at `index` of `split` (deterministic)."""

    @abc.abstractmethod
    def grade(self, example: Example, completion: str) -> Grade:
        """Checks a completion (text after the prompt, up to EOS) against the example."""

    def reward(self, example: Example, completion: str) -> float:
        return self.reward_of(self.grade(example, completion))

    def reward_of(self, grade: Grade) -> float:
        """1.0 if correct, `format_reward` if only well-formed, else 0.0."""
        if grade.correct:
            return 1.0
        return float(self.format_reward) if grade.well_formed else 0.0

    def demonstration(self, example: Example) -> str:
        """The target completion (without EOS) for a supervised warm start."""
        return example.answer

    def num_examples(self, split: Split = "train") -> int | None:
        """Size of a finite split, or None for generated tasks (indices are unbounded)."""
        return None


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def in_eval_split(problem_key: str, eval_fraction: float) -> bool:
    """Hash partition of the problem space: a problem is eval iff its hash falls below the fraction.

    The partition does not depend on the seed, so no seed ever trains on an eval problem.
    """
    digest = hashlib.blake2b(problem_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < eval_fraction


@dataclasses.dataclass(frozen=True)
class GeneratedTask(Task):
    """A task whose problems are drawn from a seeded generator; eval is a hash-held-out subset."""

    seed: int = 0  # generator seed; example i of a split depends only on (seed, split, i)
    eval_fraction: float = 0.1  # fraction of the problem space held out for eval
    format_reward: float = 0.1  # reward for a well-formed but wrong answer

    max_attempts = 10_000  # rejection-sampling budget per example

    def __post_init__(self):
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {self.format_reward}")

    @abc.abstractmethod
    def _generate(self, rng: np.random.Generator) -> Example:
        """Draws one problem."""

    def problem_key(self, example: Example) -> str:
        """Canonical identity of a problem for the train/eval split (default: the prompt)."""
        return example.prompt

    def sample(self, index: int, split: Split = "train") -> Example:
        check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        want_eval = split == "eval"
        for attempt in range(self.max_attempts):
            rng = np.random.default_rng([self.seed, SPLITS.index(split), index, attempt])
            example = self._generate(rng)
            if in_eval_split(self.problem_key(example), self.eval_fraction) == want_eval:
                return example
        raise RuntimeError(
            f"{self.name}: no {split} problem found in {self.max_attempts} draws; "
            "the problem space is too small for eval_fraction"
        )
