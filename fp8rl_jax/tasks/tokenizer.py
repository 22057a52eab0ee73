"""A fixed character-level tokenizer for the built-in toy tasks (vocab <= 64)."""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")

# digits, arithmetic, separators, lowercase letters: everything the built-in tasks print.
DEFAULT_ALPHABET = string.digits + " +-*/=(),.:;?!#%" + string.ascii_lowercase


class CharTokenizer:
    """One id per character; ids 0/1/2 are PAD/BOS/EOS and never come from text."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(SPECIAL_TOKENS) + len(alphabet)
        if self.vocab_size > 64:
            raise ValueError(f"CharTokenizer vocab_size {self.vocab_size} exceeds 64")

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text -> ids; raises ValueError naming the first character outside the alphabet."""
        ids = [BOS_ID] if add_bos else []
        for pos, c in enumerate(text):
            token = self._char_to_id.get(c)
            if token is None:
                raise ValueError(
                    f"CharTokenizer cannot encode {c!r} at position {pos} of {text!r}; "
                    f"alphabet is {self.alphabet!r}"
                )
            ids.append(token)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Ids -> text, dropping PAD/BOS and (by default) everything from the first EOS on."""
        chars = []
        for token in ids:
            token = int(token)
            if token == EOS_ID and stop_at_eos:
                break
            if token < len(SPECIAL_TOKENS):
                continue
            if token >= self.vocab_size:
                raise ValueError(f"CharTokenizer id {token} out of range [0, {self.vocab_size})")
            chars.append(self.alphabet[token - len(SPECIAL_TOKENS)])
        return "".join(chars)

    def decode_batch(self, tokens_BT: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
        """Decodes each row (e.g. generated completions) up to its first EOS."""
        return [self.decode(row) for row in np.asarray(tokens_BT)]

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
