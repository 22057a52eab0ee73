"""Stop tokens of a checkpoint: ``generation_config.json``, ``config.json`` and the tokenizer.

HF ``generate`` and vLLM stop at the ``eos_token_id`` of the checkpoint's
``generation_config.json`` (an int or a list: Qwen3 instruct models list ``<|im_end|>`` and
``<|endoftext|>``, Llama-3.1 instruct ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``);
vLLM adds the tokenizer's EOS. Hard-coding one family's ids is wrong for the others, so the
rollout reads them from the checkpoint unless the config names them.
"""

from __future__ import annotations

import json
import os


def _eos_ids(file: str) -> list[int]:
    if not os.path.isfile(file):
        return []
    with open(file) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(t) for t in eos] if isinstance(eos, list) else [int(eos)]


def checkpoint_stop_token_ids(checkpoint_dir: str, tokenizer=None) -> tuple[int, ...]:
    """The checkpoint's stop ids, in order and without repeats.

    ``generation_config.json``'s ``eos_token_id``, else ``config.json``'s, then the tokenizer's
    EOS (``tokenizer.eos_id``) when it has one. Empty when none of them names a token.
    """
    ids = _eos_ids(os.path.join(checkpoint_dir, "generation_config.json"))
    if not ids:
        ids = _eos_ids(os.path.join(checkpoint_dir, "config.json"))
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None:
        ids.append(int(eos))
    return tuple(dict.fromkeys(ids))
