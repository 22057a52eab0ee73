"""Verifiable-reward tasks, a character tokenizer, math datasets (JSONL, parquet), verifiers."""

from fp8rl_jax.tasks.answers import (
    answers_match,
    extract_final_answer,
    has_explicit_answer,
    normalize_answer,
    parse_number,
)
from fp8rl_jax.tasks.arithmetic import AdditionTask, MultiplicationTask, ReverseTask, SortTask
from fp8rl_jax.tasks.base import SPLITS, Example, GeneratedTask, Grade, Task, in_eval_split
from fp8rl_jax.tasks.batch import (
    DemonstrationBatch,
    PromptBatch,
    make_demonstration_batch,
    make_prompt_batch,
    score_completions,
)
from fp8rl_jax.tasks.chain import ChainTask, chain_answer
from fp8rl_jax.tasks.countdown import CountdownTask, grade_countdown, parse_arithmetic
from fp8rl_jax.tasks.datasets import (
    DATA_FORMATS,
    VERL_FIELDS,
    DataFields,
    MathDataset,
    MathJsonlDataset,
    MathProblem,
)
from fp8rl_jax.tasks.math_data import (
    DEFAULT_MATH_INSTRUCTION,
    MathTask,
    chat_prompt,
    make_chat_prompt_fn,
)
from fp8rl_jax.tasks.tokenizer import CharTokenizer
from fp8rl_jax.tasks.verifiers import (
    NATIVE_REWARDS,
    VERIFIERS,
    get_verifier,
    normalize_dapo_answer,
    verify_boxed,
    verify_dapo,
    verify_math,
)

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        AdditionTask,
        MultiplicationTask,
        CountdownTask,
        ReverseTask,
        SortTask,
        ChainTask,
        MathTask,
    )
}


def get_task(name: str, **kwargs) -> Task:
    """Builds a task by name, e.g. `get_task("addition", digits=3, seed=1)`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {sorted(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise TypeError(f"task {name!r}: {e}") from e


__all__ = [
    "DATA_FORMATS",
    "DEFAULT_MATH_INSTRUCTION",
    "NATIVE_REWARDS",
    "SPLITS",
    "TASKS",
    "VERIFIERS",
    "VERL_FIELDS",
    "AdditionTask",
    "ChainTask",
    "CharTokenizer",
    "CountdownTask",
    "DataFields",
    "DemonstrationBatch",
    "Example",
    "GeneratedTask",
    "Grade",
    "MathDataset",
    "MathJsonlDataset",
    "MathProblem",
    "MathTask",
    "MultiplicationTask",
    "PromptBatch",
    "ReverseTask",
    "SortTask",
    "Task",
    "answers_match",
    "chain_answer",
    "chat_prompt",
    "extract_final_answer",
    "get_task",
    "get_verifier",
    "grade_countdown",
    "has_explicit_answer",
    "in_eval_split",
    "make_chat_prompt_fn",
    "make_demonstration_batch",
    "make_prompt_batch",
    "normalize_answer",
    "normalize_dapo_answer",
    "parse_arithmetic",
    "parse_number",
    "score_completions",
    "verify_boxed",
    "verify_dapo",
    "verify_math",
]
