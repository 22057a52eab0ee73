"""load_tokenizer vs what transformers' AutoTokenizer produced (MANIFEST.json)."""

import json
import os

import jinja2
import pytest

from fp8rl_jax.models import load_tokenizer
from fp8rl_jax.models.tokenizer import Tokenizer

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "tokenizer")), reason="none")


@pytest.fixture(scope="module")
def hf():
    with open(os.path.join(ROOT, "MANIFEST.json")) as f:
        return json.load(f)["tokenizer"]


def test_special_ids_encode_decode(hf):
    tok = load_tokenizer(os.path.join(ROOT, "tokenizer"))
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (hf["eos_token_id"], hf["pad_token_id"], None)
    assert tok.encode(hf["sample_text"]) == hf["sample_ids"]
    assert tok.decode(hf["sample_ids"]) == hf["sample_decoded"]


def test_chat_template_matches_transformers(hf):
    tok = load_tokenizer(os.path.join(ROOT, "tokenizer"))
    text = tok.apply_chat_template(hf["chat_messages"], add_generation_prompt=True)
    assert text == hf["chat_text_add_generation_prompt"]
    ids = tok.apply_chat_template(hf["chat_messages"], add_generation_prompt=True, tokenize=True)
    assert ids == hf["chat_ids_add_generation_prompt"]
    sys_text = tok.apply_chat_template(hf["chat_messages_with_system"], add_generation_prompt=False)
    assert sys_text == hf["chat_text_with_system"]


def test_template_globals_raise_exception_and_tojson():
    base = load_tokenizer(os.path.join(ROOT, "tokenizer"))
    tpl = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ eos_token }}{{ messages | tojson }}"
    )
    tok = Tokenizer(base.tokenizer, base.special_tokens, tpl)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<|im_end|>[{"role": "user", "content": "é"}]'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
