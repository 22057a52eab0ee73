"""A long-response task: repeated subtraction written out step by step (issue 24, item 3).

``ch:0347-7=`` -> ``0340,0333,...,0004``: subtract the stride k from n until the next step would
go below zero, writing every intermediate value zero-padded to ``width`` digits. The response has
``steps * (width + 1) - 1`` characters, so ``min_steps`` / ``max_steps`` set the response length
(e.g. width 3, 25-75 steps: 99-299 tokens). Every value is a function of the previous one and k,
so a tiny model learns it from a short warm start, and one wrong step anywhere makes the whole
chain wrong: errors compound with length, as in long chain-of-thought answers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from fp8rl_jax.tasks.base import Example, GeneratedTask, Grade


@dataclasses.dataclass(frozen=True)
class ChainTask(GeneratedTask):
    """Written repeated subtraction: ``ch:<n>-<k>=`` -> ``n-k,n-2k,...,n mod k`` (fixed width)."""

    min_steps: int = 25  # fewest subtractions (values written) per problem
    max_steps: int = 75  # most subtractions per problem
    width: int = 3  # digits per value (zero-padded); n < 10**width
    max_stride: int = 9  # k is uniform in [1, max_stride] (one digit)
    partial_credit: float = 0.0  # a wrong chain earns this x (share of right steps)

    name: ClassVar[str] = "chain"
    prefix: ClassVar[str] = "ch"

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"chain: need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}"
            )
        if not 1 <= self.max_stride <= 9:
            raise ValueError(f"chain.max_stride must be in [1, 9], got {self.max_stride}")
        if not 0.0 <= self.partial_credit < 1.0:
            raise ValueError(f"chain.partial_credit must be in [0, 1), got {self.partial_credit}")
        if (self.max_steps + 1) * self.max_stride > 10**self.width:
            raise ValueError(
                f"chain: (max_steps + 1) * max_stride = {(self.max_steps + 1) * self.max_stride} "
                f"does not fit width={self.width} digits"
            )

    def response_length(self, steps: int) -> int:
        """Characters of a chain of ``steps`` values (EOS not counted)."""
        return steps * (self.width + 1) - 1

    def _generate(self, rng: np.random.Generator) -> Example:
        steps = int(rng.integers(self.min_steps, self.max_steps + 1))
        k = int(rng.integers(1, self.max_stride + 1))
        n = steps * k + int(rng.integers(0, k))  # exactly `steps` subtractions stay >= 0
        return Example(
            prompt=f"{self.prefix}:{n:0{self.width}d}-{k}=",
            answer=chain_answer(n, k, self.width),
            meta={"n": n, "k": k, "steps": steps},
        )

    def grade(self, example: Example, completion: str) -> ChainGrade:
        text = completion.strip()
        well_formed = re.fullmatch(rf"\d{{{self.width}}}(,\d{{{self.width}}})*", text) is not None
        n_values = len(example.answer.split(","))
        right = right_steps(text, example.meta["n"], example.meta["k"], self.width, n_values)
        return ChainGrade(
            correct=text == example.answer, well_formed=well_formed, steps=right / n_values
        )

    def reward_of(self, grade: Grade) -> float:
        """1.0 if correct, else the larger of the format reward and partial_credit x steps."""
        partial = self.partial_credit * getattr(grade, "steps", 0.0)
        return 1.0 if grade.correct else max(super().reward_of(grade), partial)


@dataclasses.dataclass(frozen=True)
class ChainGrade(Grade):
    """A chain's grade, with the share of right subtraction steps."""

    steps: float = 0.0  # right steps among the first values / values in the answer


def right_steps(text: str, n: int, k: int, width: int, n_values: int) -> int:
    """Steps i < n_values whose value v_i is ``width`` digits and v_i = v_{i-1} − k (v_{-1} = n).

    Each step is judged from the value written before it, so one slip costs one step, not the
    rest of the chain (dense credit for GRPO); values past the answer's count are ignored.
    """
    prev, right = n, 0
    for token in text.split(",")[:n_values]:
        value = int(token) if len(token) == width and token.isdigit() else None
        right += value is not None and value == prev - k
        prev = value if value is not None else -(10**width)
    return right


def chain_answer(n: int, k: int, width: int) -> str:
    """``n-k, n-2k, ...`` while >= 0, each zero-padded to ``width`` digits, comma-separated."""
    return ",".join(f"{v:0{width}d}" for v in range(n - k, -1, -k))
