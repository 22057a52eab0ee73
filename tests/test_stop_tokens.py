"""Stop tokens from the checkpoint (generation_config.json, config.json, tokenizer) or config."""

import dataclasses
import json
from pathlib import Path

import pytest

from fp8rl_jax.generation import RolloutConfig
from fp8rl_jax.models import checkpoint_stop_token_ids, load_tokenizer
from fp8rl_jax.train.experiment import Experiment, ModelSpec
from fp8rl_jax.train.setup import resolve_stop_tokens

FIX = Path(__file__).resolve().parent / "fixtures" / "hf"


@dataclasses.dataclass
class _Tok:
    eos_id: int | None


def _ckpt(tmp_path, generation=None, config=None):
    tmp_path.mkdir(exist_ok=True)
    for name, content in (("generation_config.json", generation), ("config.json", config)):
        if content is not None:
            (tmp_path / name).write_text(json.dumps(content))
    return str(tmp_path)


def test_generation_config_list_then_tokenizer_eos(tmp_path):
    # Llama-3.1-Instruct's generation_config lists three ids; the tokenizer's EOS is among them
    path = _ckpt(tmp_path, {"eos_token_id": [128001, 128008, 128009]}, {"eos_token_id": 128001})
    assert checkpoint_stop_token_ids(path, _Tok(128009)) == (128001, 128008, 128009)
    assert checkpoint_stop_token_ids(path, _Tok(7)) == (128001, 128008, 128009, 7)


def test_config_json_is_the_fallback(tmp_path):
    path = _ckpt(tmp_path, {"pad_token_id": 0}, {"eos_token_id": 151643})
    assert checkpoint_stop_token_ids(path, _Tok(151645)) == (151643, 151645)
    assert checkpoint_stop_token_ids(_ckpt(tmp_path / "empty"), _Tok(None)) == ()


def test_fixture_checkpoint_stops_at_the_tokenizers_im_end():
    # the qwen3 fixture names no eos id; its tokenizer's EOS is <|im_end|> = 2
    tok = load_tokenizer(FIX / "tokenizer")
    assert checkpoint_stop_token_ids(str(FIX / "qwen3"), tok) == (2,)


def test_resolve_stop_tokens_override_wins(tmp_path):
    path = _ckpt(tmp_path, {"eos_token_id": 5})
    auto = Experiment(model=ModelSpec(hf_checkpoint=path))
    assert resolve_stop_tokens(auto, _Tok(None)).rollout.stop_token_ids == (5,)
    override = dataclasses.replace(auto, rollout=RolloutConfig(stop_token_ids=(9,)))
    assert resolve_stop_tokens(override, _Tok(None)).rollout.stop_token_ids == (9,)
    tiny = Experiment()  # no checkpoint: () stays ()
    assert resolve_stop_tokens(tiny, _Tok(3)).rollout.stop_token_ids == ()
    empty = Experiment(model=ModelSpec(hf_checkpoint=_ckpt(tmp_path / "empty")))
    with pytest.raises(ValueError, match="rollout.stop_token_ids"):
        resolve_stop_tokens(empty, _Tok(None))
