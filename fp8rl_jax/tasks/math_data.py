"""Math problems with verifiable answers: chat-template prompts and the math task."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from fp8rl_jax.tasks.base import Example, Grade, Split, Task, check_split, in_eval_split
from fp8rl_jax.tasks.datasets import MathDataset, MathProblem, Message
from fp8rl_jax.tasks.verifiers import NATIVE_REWARDS, VERIFIERS, get_verifier

DEFAULT_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

Prompt = str | Sequence[Message]  # a question, or chat messages (veRL's `prompt` column)


class ChatTokenizer(Protocol):
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


def chat_prompt(
    tokenizer: ChatTokenizer,
    question: Prompt,
    *,
    system: str | None = None,
    instruction: str = DEFAULT_MATH_INSTRUCTION,
) -> str:
    """The prompt in the tokenizer's chat template, ending with the assistant turn.

    A question string becomes one user turn (after an optional system turn) with `instruction`
    appended; chat messages (veRL datasets, whose messages carry their own instruction) go to
    the template as they are.
    """
    if isinstance(question, str):
        messages = [{"role": "system", "content": system}] if system else []
        content = f"{question}\n{instruction}" if instruction else question
        messages.append({"role": "user", "content": content})
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in question]
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
) -> Callable[[Prompt], str]:
    """question or chat messages -> chat prompt, for `MathTask(prompt_fn=...)`."""
    return lambda question: chat_prompt(tokenizer, question, system=system, instruction=instruction)


def _plain_prompt(question: Prompt) -> str:
    if not isinstance(question, str):
        raise ValueError(
            "a chat-message prompt needs a chat template: "
            "MathTask(prompt_fn=make_chat_prompt_fn(tokenizer))"
        )
    return question


@dataclasses.dataclass(frozen=True)
class MathTask(Task):
    """Problems from JSONL or parquet files, graded by `verifier` ("boxed" | "dapo" |
    "math_verify", see `fp8rl_jax.tasks.verifiers`).

    Reward: 1 correct, `format_reward` well-formed but wrong, else 0; with `native_reward` the
    verifier's own pair instead (dapo: +1 / -1, as veRL's DAPO recipe trains). Without an eval
    file, a hash of the question holds out `eval_fraction` of the train file. Indices wrap
    around the split (epochs).
    """

    train: MathDataset
    eval: MathDataset | None = None
    prompt_fn: Callable[[Prompt], str] = _plain_prompt  # e.g. make_chat_prompt_fn(tokenizer)
    eval_fraction: float = 0.1  # used only without an eval file
    format_reward: float = 0.1  # reward for an explicit but wrong final answer
    strict: bool = False  # verifier "boxed": only \\boxed / #### answers count (no last number)
    verifier: str = "boxed"  # "boxed" | "dapo" | "math_verify"
    native_reward: bool = False  # reward with the verifier's own values (ignores format_reward)

    name: ClassVar[str] = "math"

    def __post_init__(self):
        if self.verifier not in VERIFIERS:
            raise ValueError(
                f"math task: verifier must be one of {VERIFIERS}, got {self.verifier!r}"
            )
        object.__setattr__(self, "_verify", get_verifier(self.verifier, strict=self.strict))
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
        problem: MathProblem = problems[index % len(problems)]
        return Example(
            prompt=self.prompt_fn(problem.prompt),
            answer=problem.answer,
            meta={
                "question": problem.question,
                "solution": problem.solution,
                "data_source": problem.data_source,
                "extra_info": problem.extra_info,
            },
        )

    def demonstration(self, example: Example) -> str:
        if self.verifier == "dapo":
            return f"Answer: {example.answer}"
        return f"\\boxed{{{example.answer}}}"

    def grade(self, example: Example, completion: str) -> Grade:
        return self._verify(completion, example.answer)

    def reward_of(self, grade: Grade) -> float:
        if not self.native_reward:
            return super().reward_of(grade)
        correct_reward, wrong_reward = NATIVE_REWARDS[self.verifier]
        return correct_reward if grade.correct else wrong_reward
