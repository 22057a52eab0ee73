"""Digit tasks for tiny policies: addition, multiplication, reversing and sorting digit strings."""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import ClassVar

import numpy as np

from fp8rl_jax.tasks.base import Example, GeneratedTask, Grade

_INTEGER = re.compile(r"-?\d+")
_DIGITS = re.compile(r"\d+")


def _grade_exact(completion: str, answer: str, well_formed: re.Pattern[str]) -> Grade:
    text = completion.strip()
    return Grade(correct=text == answer, well_formed=well_formed.fullmatch(text) is not None)


@dataclasses.dataclass(frozen=True)
class _BinaryArithmeticTask(GeneratedTask):
    """`a<op>b=` -> the decimal result; operands are uniform with up to `digits` digits."""

    digits: int = 2  # operands are uniform in [0, 10**digits)

    op: ClassVar[str]

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.digits <= 9:
            raise ValueError(f"{self.name}.digits must be in [1, 9], got {self.digits}")

    @abc.abstractmethod
    def _result(self, a: int, b: int) -> int:
        """The answer to ``a <op> b``."""

    def _generate(self, rng: np.random.Generator) -> Example:
        a, b = (int(x) for x in rng.integers(0, 10**self.digits, size=2))
        return Example(
            prompt=f"{a}{self.op}{b}=", answer=str(self._result(a, b)), meta={"a": a, "b": b}
        )

    def grade(self, example: Example, completion: str) -> Grade:
        return _grade_exact(completion, example.answer, _INTEGER)


@dataclasses.dataclass(frozen=True)
class AdditionTask(_BinaryArithmeticTask):
    """n-digit addition, e.g. "12+34=" -> "46"."""

    name: ClassVar[str] = "addition"
    op: ClassVar[str] = "+"

    def _result(self, a: int, b: int) -> int:
        return a + b


@dataclasses.dataclass(frozen=True)
class MultiplicationTask(_BinaryArithmeticTask):
    """Small multiplication, e.g. "7*8=" -> "56"."""

    digits: int = 1  # operands are uniform in [0, 10**digits)

    name: ClassVar[str] = "multiplication"
    op: ClassVar[str] = "*"

    def _result(self, a: int, b: int) -> int:
        return a * b


@dataclasses.dataclass(frozen=True)
class _DigitStringTask(GeneratedTask):
    """`<prefix>:<digits>=` -> a permutation of the digits."""

    min_len: int = 3  # shortest digit string
    max_len: int = 6  # longest digit string

    prefix: ClassVar[str]

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"{self.name}: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}"
            )

    @abc.abstractmethod
    def _transform(self, digits: str) -> str:
        """The answer for a digit string."""

    def _generate(self, rng: np.random.Generator) -> Example:
        length = int(rng.integers(self.min_len, self.max_len + 1))
        digits = "".join(str(d) for d in rng.integers(0, 10, size=length))
        return Example(
            prompt=f"{self.prefix}:{digits}=",
            answer=self._transform(digits),
            meta={"digits": digits},
        )

    def grade(self, example: Example, completion: str) -> Grade:
        text = completion.strip()
        well_formed = _DIGITS.fullmatch(text) is not None and len(text) == len(example.answer)
        return Grade(correct=text == example.answer, well_formed=well_formed)


@dataclasses.dataclass(frozen=True)
class ReverseTask(_DigitStringTask):
    """Reverse a digit string, e.g. "rev:123=" -> "321"."""

    name: ClassVar[str] = "reverse"
    prefix: ClassVar[str] = "rev"

    def _transform(self, digits: str) -> str:
        return digits[::-1]


@dataclasses.dataclass(frozen=True)
class SortTask(_DigitStringTask):
    """Sort a digit string ascending, e.g. "sort:3141=" -> "1134"."""

    name: ClassVar[str] = "sort"
    prefix: ClassVar[str] = "sort"

    def _transform(self, digits: str) -> str:
        return "".join(sorted(digits))
