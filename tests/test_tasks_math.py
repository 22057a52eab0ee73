"""Math JSONL loader, final-answer extraction, answer equivalence and chat prompting."""

import json
import pathlib

import pytest

from fp8rl_jax.tasks import (
    Example,
    MathJsonlDataset,
    MathTask,
    answers_match,
    chat_prompt,
    extract_final_answer,
    get_task,
    make_chat_prompt_fn,
    parse_number,
    score_completions,
)

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "data" / "math_tiny.jsonl"


# --- loader ------------------------------------------------------------------------------------


def test_loads_fixture_and_extracts_gold_answers():
    ds = MathJsonlDataset(FIXTURE)
    assert len(ds) == 5
    assert [p.answer for p in ds] == ["72", "1,000", "\\frac{3}{4}", "-5", "0.5"]
    assert ds[0].question.startswith("Natalia") and ds[0].solution.endswith("#### 72")


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        MathJsonlDataset(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n\n{"question": "q2", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: invalid JSON"):
        MathJsonlDataset(bad)
    bad.write_text('{"question": "q", "answer": "1"}\n{"problem": "q2", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'question'.*'problem'"):
        MathJsonlDataset(bad)
    bad.write_text('["q", "1"]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object, got list"):
        MathJsonlDataset(bad)
    bad.write_text('{"question": "q", "answer": null}\n')
    with pytest.raises(ValueError, match="'answer' must be a string or a number"):
        MathJsonlDataset(bad)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        MathJsonlDataset(bad)


def test_loader_configurable_field_names(tmp_path):
    path = tmp_path / "dapo.jsonl"
    path.write_text(json.dumps({"prompt": "1+1?", "solution": "2"}) + "\n")
    ds = MathJsonlDataset(path, question_key="prompt", answer_key="solution")
    assert ds[0].question == "1+1?" and ds[0].answer == "2"


# --- verifier ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),  # last box wins
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}"),  # nested braces
        ("\\boxed{ {a, b} }", "{a, b}"),
        ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### -1,250\nextra", "-1,250"),
        ("I think it is 12, or maybe 3/4", "3/4"),  # last-number fallback
        ("The total is -17.5 dollars.", "-17.5"),
        ("no digits here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_without_fallback():
    assert extract_final_answer("the answer is 5", fallback_last_number=False) is None


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("1,000", "1000"),
        ("3/4", "\\frac{3}{4}"),
        ("0.75", "\\dfrac34"),
        ("-5", "-5.0"),
        ("-\\frac{1}{2}", "-0.5"),
        ("$42$", "42"),
        ("42.", "42"),
        ("x = 7", "7"),
        ("50\\%", "50"),
        ("50%", "0.5"),
        ("\\text{Monday}", "monday"),
        ("90^\\circ", "90"),
    ],
)
def test_answers_match(pred, gold):
    assert answers_match(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("4", "-4"),
        ("3/4", "4/3"),
        ("1,001", "1000"),
        ("0.33", "1/3"),
        (None, "1"),
        ("tuesday", "monday"),
    ],
)
def test_answers_do_not_match(pred, gold):
    assert not answers_match(pred, gold)


def test_parse_number_edge_cases():
    assert parse_number("1/0") is None
    assert parse_number("\\frac{1}{0}") is None
    assert parse_number("abc") is None
    assert parse_number("12,34") is None  # not a thousands separator
    assert parse_number(".5")[0] == parse_number("1/2")[0]


# --- task and chat prompts ---------------------------------------------------------------------


class FakeChatTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True):
        body = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return body + ("<|assistant|>" if add_generation_prompt else "")


def test_chat_prompt_duck_types_the_tokenizer():
    text = chat_prompt(FakeChatTokenizer(), "What is 2+2?", system="Be brief.")
    assert text.startswith("<|system|>Be brief.\n<|user|>What is 2+2?\nPlease reason")
    assert text.endswith("<|assistant|>")

    class IdsTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return [1, 2, 3]

    with pytest.raises(TypeError, match="expected str"):
        chat_prompt(IdsTokenizer(), "q")


def test_math_task_rewards_and_splits():
    ds = MathJsonlDataset(FIXTURE)
    with pytest.raises(ValueError, match="train split is empty"):
        MathTask(train=ds, eval=ds)  # every train question is in eval: nothing left to train on
    task = get_task(
        "math", train=ds, eval_fraction=0.5, prompt_fn=make_chat_prompt_fn(FakeChatTokenizer())
    )
    n_train, n_eval = task.num_examples("train"), task.num_examples("eval")
    assert n_train + n_eval == 5 and n_train and n_eval
    train_q = {task.sample(i).meta["question"] for i in range(n_train)}
    eval_q = {task.sample(i, "eval").meta["question"] for i in range(n_eval)}
    assert not train_q & eval_q
    assert task.sample(n_train) == task.sample(0)  # indices wrap around (epochs)
    ex = task.sample(0)
    assert ex.prompt.startswith("<|user|>") and ex.prompt.endswith("<|assistant|>")
    ex = Example(prompt="q", answer="1,000")
    texts = [
        f"reasoning... \\boxed{{{ex.answer}}}",  # correct and explicit
        "reasoning... \\boxed{123456789}",  # explicit but wrong: format reward
        f"so it is {ex.answer}",  # correct via last-number fallback (not strict)
        "no idea",
    ]
    rewards_B, accuracy = score_completions(task, [ex] * 4, texts)
    assert rewards_B.tolist() == pytest.approx([1.0, 0.1, 1.0, 0.0])
    assert accuracy == 0.5
    strict = MathTask(train=ds, eval_fraction=0.5, strict=True)
    assert strict.reward(ex, f"so it is {ex.answer}") == 0.0
    assert strict.reward(ex, strict.demonstration(ex)) == 1.0
