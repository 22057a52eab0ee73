"""HF tokenizers without transformers: ``tokenizer.json`` plus the jinja chat template."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _token_str(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(template: str) -> jinja2.Template:
    """The environment HF ``apply_chat_template`` uses (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_chat_template(path: str, config: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):  # transformers v5 saves the template beside the config
        with open(jinja_file) as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


@dataclasses.dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` with special-token ids and the HF chat template."""

    tokenizer: tokenizers.Tokenizer
    special_tokens: dict[str, str | None]  # bos_token, eos_token, pad_token, unk_token strings
    chat_template: str | None

    def _id(self, key: str) -> int | None:
        tok = self.special_tokens.get(key)
        return None if tok is None else self.tokenizer.token_to_id(tok)

    @property
    def eos_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_id(self) -> int | None:
        """The pad token's id, falling back to eos (as most RL stacks do) when none is set."""
        pad = self._id("pad_token")
        return self.eos_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Renders ``chat_template`` like HF (``raise_exception``, ``tojson``, special tokens)."""
        if self.chat_template is None:
            raise ValueError("tokenizer has no chat_template")
        text = _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **kwargs,
        )
        return self.encode(text) if tokenize else text


def load_tokenizer(path) -> Tokenizer:
    """From a directory with ``tokenizer.json`` (and optionally ``tokenizer_config.json``)."""
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"tokenizer.json not found in {path}")
    config: dict = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
    special = {
        k: _token_str(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    return Tokenizer(
        tokenizers.Tokenizer.from_file(tok_file), special, _read_chat_template(path, config)
    )
