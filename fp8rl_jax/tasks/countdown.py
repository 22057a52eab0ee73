"""Countdown: reach a target from given numbers with + - * (optionally /), each number at most once.

The verifier parses the expression with a small recursive-descent parser over exact rationals;
nothing is ever passed to `eval`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from fractions import Fraction
from typing import ClassVar

import numpy as np

from fp8rl_jax.tasks.base import Example, GeneratedTask, Grade

_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")
MAX_EXPRESSION_CHARS = 64
_MAX_DEPTH = 8


@dataclasses.dataclass(frozen=True)
class ParsedExpression:
    """An arithmetic expression's exact value (None on division by zero) and its literals."""

    value: Fraction | None
    literals: tuple[int, ...]


class _Parser:
    """expr := term ((+|-) term)*; term := factor ((*|/) factor)*; factor := int | (expr)."""

    def __init__(self, tokens: list[str], allow_division: bool):
        self.tokens = tokens
        self.pos = 0
        self.allow_division = allow_division
        self.literals: list[int] = []
        self.divided_by_zero = False

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self._peek() in ("*", "/"):
            op = self._take()
            if op == "/" and not self.allow_division:
                raise ValueError("division is not allowed")
            rhs = self.factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                self.divided_by_zero = True
                value = Fraction(0)
            else:
                value = value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        token = self._take()
        if token == "(":
            if depth >= _MAX_DEPTH:
                raise ValueError(f"parentheses nested deeper than {_MAX_DEPTH}")
            value = self.expr(depth + 1)
            if self._take() != ")":
                raise ValueError("expected ')'")
            return value
        if token.isdigit():
            self.literals.append(int(token))
            return Fraction(int(token))
        raise ValueError(f"unexpected token {token!r}")


def parse_arithmetic(expression: str, *, allow_division: bool = False) -> ParsedExpression:
    """Parses integers, + - * / and parentheses exactly; raises ValueError if malformed.

    Unary minus is not accepted (countdown numbers are positive). Division by zero is not a
    parse error: it returns `value=None`.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, end = [], 0
    for match in _TOKEN.finditer(expression):
        if match.start() != end:
            break
        tokens.append(match.group(1))
        end = match.end()
    if expression[end:].strip():
        raise ValueError(f"unexpected character {expression[end:].strip()[0]!r}")
    if not tokens:
        raise ValueError("empty expression")
    parser = _Parser(tokens, allow_division)
    value = parser.expr(depth=0)
    if parser.pos != len(tokens):
        raise ValueError(f"unexpected token {tokens[parser.pos]!r}")
    return ParsedExpression(
        value=None if parser.divided_by_zero else value, literals=tuple(parser.literals)
    )


def grade_countdown(
    expression: str, numbers: tuple[int, ...], target: int, *, allow_division: bool = False
) -> Grade:
    """Correct iff the expression uses each given number at most once and equals the target."""
    try:
        parsed = parse_arithmetic(expression.strip(), allow_division=allow_division)
    except ValueError:
        return Grade(correct=False, well_formed=False)
    uses_allowed = not collections.Counter(parsed.literals) - collections.Counter(numbers)
    correct = uses_allowed and parsed.value is not None and parsed.value == target
    return Grade(correct=correct, well_formed=True)


@dataclasses.dataclass(frozen=True)
class CountdownTask(GeneratedTask):
    """ "3,5,7;22=" -> an expression such as "3*5+7" over the numbers that evaluates to 22."""

    num_numbers: int = 3  # how many numbers are given
    max_number: int = 10  # numbers are uniform in [1, max_number]
    max_target: int = 100  # targets are in [0, max_target]
    allow_division: bool = False  # accept '/' in answers (exact rationals; x/0 is wrong)

    name: ClassVar[str] = "countdown"

    def __post_init__(self):
        super().__post_init__()
        if not 2 <= self.num_numbers <= 6:
            raise ValueError(f"countdown.num_numbers must be in [2, 6], got {self.num_numbers}")
        if self.max_number < 1 or self.max_target < 1:
            raise ValueError("countdown.max_number and max_target must be >= 1")

    def _generate(self, rng: np.random.Generator) -> Example:
        numbers = tuple(int(x) for x in rng.integers(1, self.max_number + 1, self.num_numbers))
        for _ in range(100):
            order = rng.permutation(self.num_numbers)
            ops = rng.choice(["+", "-", "*"], size=self.num_numbers - 1)
            expression = str(numbers[order[0]])
            for op, i in zip(ops, order[1:]):
                expression += f"{op}{numbers[i]}"
            value = parse_arithmetic(expression).value
            if value is not None and 0 <= value <= self.max_target:
                target = int(value)
                return Example(
                    prompt=f"{','.join(map(str, numbers))};{target}=",
                    answer=expression,  # one reference solution; any valid expression is correct
                    meta={"numbers": numbers, "target": target},
                )
        raise RuntimeError(
            f"countdown: no target in [0, {self.max_target}] reachable from {numbers} in 100 draws"
        )

    def problem_key(self, example: Example) -> str:
        numbers = sorted(example.meta["numbers"])
        return f"{numbers};{example.meta['target']}"

    def grade(self, example: Example, completion: str) -> Grade:
        return grade_countdown(
            completion,
            example.meta["numbers"],
            example.meta["target"],
            allow_division=self.allow_division,
        )
