"""Host-side batching: GRPO prompt groups, demonstration batches, and completion scoring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from fp8rl_jax.tasks.base import Example, Split, Task


class TokenizerLike(Protocol):
    """What batching needs from a tokenizer (CharTokenizer, or an HF tokenizer wrapper)."""

    pad_id: int
    bos_id: int | None  # None: the tokenizer has no BOS and none is added
    eos_id: int

    def encode(self, text: str) -> Sequence[int]: ...


class PromptBatch(NamedTuple):
    tokens_BP: np.ndarray  # int32 [B, P], left-padded with pad_id; B = len(indices) * group_size
    lens_B: np.ndarray  # int32 [B], prompt length without padding
    examples: list[Example]  # [B], each problem repeated group_size times consecutively


class DemonstrationBatch(NamedTuple):
    prompt_tokens_BP: np.ndarray  # int32 [B, P], left-padded like PromptBatch
    prompt_lens_B: np.ndarray  # int32 [B]
    completion_tokens_BT: np.ndarray  # int32 [B, T], demonstration + EOS, right-padded
    completion_mask_BT: np.ndarray  # bool [B, T], True on demonstration and EOS tokens


def _encode_prompt(tokenizer: TokenizerLike, prompt: str, add_bos: bool) -> list[int]:
    """Prompt ids, with BOS first if asked and the tokenizer has one (once: a chat template may
    already start with it)."""
    ids = list(tokenizer.encode(prompt))
    bos_id = tokenizer.bos_id if add_bos else None
    if bos_id is None or (ids and ids[0] == bos_id):
        return ids
    return [bos_id, *ids]


def _left_pad(rows: list[list[int]], pad_to: int | None, pad_id: int) -> tuple[np.ndarray, ...]:
    lens_B = np.array([len(r) for r in rows], np.int32)
    width = int(lens_B.max()) if pad_to is None else pad_to
    if lens_B.max() > width:
        raise ValueError(f"prompt of {lens_B.max()} tokens does not fit pad_to={width}")
    tokens_BP = np.full((len(rows), width), pad_id, np.int32)
    for b, row in enumerate(rows):
        tokens_BP[b, width - len(row) :] = row
    return tokens_BP, lens_B


def make_prompt_batch(
    task: Task,
    tokenizer: TokenizerLike,
    indices: Sequence[int],
    group_size: int,
    pad_to: int | None = None,
    *,
    split: Split = "train",
    add_bos: bool = True,
) -> PromptBatch:
    """Encodes problems `indices` of `split`, each repeated `group_size` times (a GRPO group).

    With `add_bos`, BOS is prepended unless the tokenizer has none or the prompt starts with it.
    """
    if group_size < 1 or not len(indices):
        raise ValueError(f"need group_size >= 1 and some indices, got {group_size}, {indices}")
    problems = [task.sample(int(i), split) for i in indices]
    examples = [ex for ex in problems for _ in range(group_size)]
    rows = [_encode_prompt(tokenizer, ex.prompt, add_bos) for ex in examples]
    tokens_BP, lens_B = _left_pad(rows, pad_to, tokenizer.pad_id)
    return PromptBatch(tokens_BP, lens_B, examples)


def make_demonstration_batch(
    task: Task,
    tokenizer: TokenizerLike,
    indices: Sequence[int],
    pad_to: int | None = None,
    completion_len: int | None = None,
    *,
    split: Split = "train",
    add_bos: bool = True,
) -> DemonstrationBatch:
    """Prompts and target completions (`task.demonstration` + EOS) for a supervised warm start."""
    examples = [task.sample(int(i), split) for i in indices]
    tokens_BP, lens_B = _left_pad(
        [_encode_prompt(tokenizer, ex.prompt, add_bos) for ex in examples], pad_to, tokenizer.pad_id
    )
    targets = [[*tokenizer.encode(task.demonstration(ex)), tokenizer.eos_id] for ex in examples]
    width = max(len(t) for t in targets) if completion_len is None else completion_len
    completion_BT = np.full((len(examples), width), tokenizer.pad_id, np.int32)
    mask_BT = np.zeros((len(examples), width), bool)
    for b, target in enumerate(targets):
        if len(target) > width:
            raise ValueError(
                f"demonstration of {len(target)} tokens exceeds completion_len={width}"
            )
        completion_BT[b, : len(target)] = target
        mask_BT[b, : len(target)] = True
    return DemonstrationBatch(tokens_BP, lens_B, completion_BT, mask_BT)


def score_completions(
    task: Task, examples: Sequence[Example], completion_texts: Sequence[str]
) -> tuple[np.ndarray, float]:
    """Rewards float32 [B] (1 correct, format_reward well-formed, else 0) and the exact accuracy."""
    if len(examples) != len(completion_texts):
        raise ValueError(f"{len(examples)} examples but {len(completion_texts)} completions")
    grades = [task.grade(ex, text) for ex, text in zip(examples, completion_texts)]
    rewards_B = np.array([task.reward_of(g) for g in grades], np.float32)
    accuracy = float(np.mean([g.correct for g in grades])) if grades else 0.0
    return rewards_B, accuracy
