"""Math problems from local JSONL files, chat-template prompts, and a boxed-answer task."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from fp8rl_jax.tasks.answers import answers_match, extract_final_answer, has_explicit_answer
from fp8rl_jax.tasks.base import Example, Grade, Split, Task, check_split, in_eval_split

DEFAULT_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One JSONL record: the question, its full reference solution, and the final answer."""

    question: str
    solution: str  # the raw answer field (a GSM8K solution ending in "#### x", or just "x")
    answer: str  # the extracted final answer


class MathJsonlDataset(Sequence[MathProblem]):
    """Reads `{question_key: str, answer_key: str | number}` objects, one per line."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        question_key: str = "question",
        answer_key: str = "answer",
    ):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"math dataset file not found: {self.path}")
        self.problems = tuple(self._read(question_key, answer_key))
        if not self.problems:
            raise ValueError(f"{self.path}: no records")

    def _read(self, question_key: str, answer_key: str):
        with open(self.path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{line_no}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{where}: expected a JSON object, got {type(record).__name__}"
                    )
                yield _problem_from_record(record, question_key, answer_key, where)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index):  # noqa: ANN001 (int or slice, as Sequence)
        return self.problems[index]


def _problem_from_record(
    record: Mapping[str, Any], question_key: str, answer_key: str, where: str
) -> MathProblem:
    for key in (question_key, answer_key):
        if key not in record:
            raise ValueError(f"{where}: missing field {key!r} (fields present: {sorted(record)})")
    question, solution = record[question_key], record[answer_key]
    if not isinstance(question, str):
        raise ValueError(f"{where}: field {question_key!r} must be a string")
    if isinstance(solution, bool) or not isinstance(solution, str | int | float):
        raise ValueError(f"{where}: field {answer_key!r} must be a string or a number")
    solution = str(solution)
    answer = extract_final_answer(solution, fallback_last_number=False) or solution.strip()
    if not answer:
        raise ValueError(f"{where}: field {answer_key!r} is empty")
    return MathProblem(question=question, solution=solution, answer=answer)


class ChatTokenizer(Protocol):
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


def chat_prompt(
    tokenizer: ChatTokenizer,
    question: str,
    *,
    system: str | None = None,
    instruction: str = DEFAULT_MATH_INSTRUCTION,
) -> str:
    """The question wrapped in the tokenizer's chat template, ending with the assistant turn."""
    messages = [{"role": "system", "content": system}] if system else []
    content = f"{question}\n{instruction}" if instruction else question
    messages.append({"role": "user", "content": content})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template returned {type(text).__name__}, expected str "
            "(a transformers tokenizer needs tokenize=False)"
        )
    return text


def make_chat_prompt_fn(
    tokenizer: ChatTokenizer,
    *,
    system: str | None = None,
    instruction: str = DEFAULT_MATH_INSTRUCTION,
) -> Callable[[str], str]:
    """question -> chat prompt, for `MathTask(prompt_fn=...)`."""
    return lambda question: chat_prompt(tokenizer, question, system=system, instruction=instruction)


@dataclasses.dataclass(frozen=True)
class MathTask(Task):
    """Problems from JSONL files; reward 1 for a matching final answer, `format_reward` for an
    explicit (\\boxed / ####) but wrong answer.

    Without an eval file, a hash of the question holds out `eval_fraction` of the train file.
    Indices wrap around the split (epochs).
    """

    train: MathJsonlDataset
    eval: MathJsonlDataset | None = None
    prompt_fn: Callable[[str], str] = lambda question: question  # e.g. make_chat_prompt_fn(tok)
    eval_fraction: float = 0.1  # used only without an eval file
    format_reward: float = 0.1  # reward for an explicit but wrong final answer
    strict: bool = False  # only \\boxed / #### answers count (no last-number fallback)

    name: ClassVar[str] = "math"

    def __post_init__(self):
        if self.eval is None:
            held_out = [in_eval_split(p.question, self.eval_fraction) for p in self.train]
            splits = {
                "train": tuple(p for p, h in zip(self.train, held_out) if not h),
                "eval": tuple(p for p, h in zip(self.train, held_out) if h),
            }
        else:
            eval_questions = {p.question for p in self.eval}
            splits = {
                "train": tuple(p for p in self.train if p.question not in eval_questions),
                "eval": tuple(self.eval),
            }
        for split, problems in splits.items():
            if not problems:
                raise ValueError(f"math task: the {split} split is empty")
        object.__setattr__(self, "_splits", splits)

    def num_examples(self, split: Split = "train") -> int | None:
        check_split(split)
        return len(self._splits[split])

    def sample(self, index: int, split: Split = "train") -> Example:
        check_split(split)
        problems = self._splits[split]
        problem = problems[index % len(problems)]
        return Example(
            prompt=self.prompt_fn(problem.question),
            answer=problem.answer,
            meta={"question": problem.question, "solution": problem.solution},
        )

    def demonstration(self, example: Example) -> str:
        return f"\\boxed{{{example.answer}}}"

    def grade(self, example: Example, completion: str) -> Grade:
        prediction = extract_final_answer(completion, fallback_last_number=not self.strict)
        return Grade(
            correct=answers_match(prediction, example.answer),
            well_formed=has_explicit_answer(completion),
        )
