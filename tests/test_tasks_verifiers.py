"""Verifiers "boxed", "dapo" (veRL math_dapo) and "math_verify" (HF) on a table of tricky answers.

The boxed and dapo outcomes are worked out by hand from their rules (see the comments); the
math_verify column is math-verify 0.9.0's behaviour, checked by running it.
"""

import importlib.util
import sys
import threading

import pytest

from fp8rl_jax.tasks import (
    Example,
    MathJsonlDataset,
    MathTask,
    get_verifier,
    normalize_dapo_answer,
    verify_boxed,
    verify_dapo,
    verify_math,
)

requires_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="math-verify not installed (pip install 'fp8rl_jax[math]')",
)
VERIFY = {"boxed": verify_boxed, "dapo": verify_dapo, "math_verify": verify_math}

FILLER = "and so on. " * 40  # 440 characters: pushes an answer out of DAPO's last 300

# (case, ground truth, completion, correct for: boxed, dapo, math_verify)
TRICKY = [
    # boxed: 3/4 == \frac{3}{4} as rationals; dapo: strings "3/4" != "\frac{3}{4}".
    ("fraction_plain_vs_latex", "\\frac{3}{4}", "so \\boxed{3/4}\nAnswer: 3/4", 1, 0, 1),
    # boxed normalizes \dfrac to \frac; dapo does not.
    ("dfrac", "\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}\nAnswer: \\dfrac{1}{2}", 1, 0, 1),
    ("decimal_vs_fraction", "\\frac{1}{2}", "\\boxed{0.5}\nAnswer: 0.5", 1, 0, 1),
    # dapo rewrites \frac12 -> \frac{1}{2}; boxed parses \frac12 as 1/2.
    ("shorthand_frac", "\\frac{1}{2}", "\\boxed{\\frac12}\nAnswer: \\frac12", 1, 1, 1),
    # boxed keeps the unit ("5cm" != "5"); dapo removes "cm" and spaces.
    ("units", "5", "\\boxed{5\\text{ cm}}\nAnswer: 5 cm", 0, 1, 1),
    ("thousands", "1000", "\\boxed{1,000}\nAnswer: 1,000", 1, 1, 1),
    # dapo drops commas only when the rest is all digits: "-1,000" keeps its comma.
    ("negative_thousands", "-1000", "\\boxed{-1,000}\nAnswer: -1,000", 1, 0, 1),
    ("negative", "-3", "\\boxed{-3}\nAnswer: -3", 1, 1, 1),
    # U+2212 minus: boxed reads "5", dapo compares "−5" to "-5", math-verify parses nothing.
    ("unicode_minus", "-5", "Answer: −5", 0, 0, 0),
    # Sets and lists: only math-verify compares them as sets.
    ("set_order", "\\{1, 2\\}", "\\boxed{\\{2, 1\\}}\nAnswer: \\{2, 1\\}", 0, 0, 1),
    ("list_order", "1, 2", "\\boxed{2, 1}\nAnswer: 2, 1", 0, 0, 1),
    ("interval", "(0, 1]", "\\boxed{(0,1]}\nAnswer: (0,1]", 1, 1, 1),
    # math-verify compares a relation with an interval only when the prediction is a set.
    ("interval_vs_inequality", "(-\\infty, 3)", "\\boxed{x < 3}\nAnswer: x < 3", 0, 0, 0),
    # Answer formats: dapo needs "Answer:"; boxed falls back to the last number.
    ("boxed_only", "7", "The answer is \\boxed{7}.", 1, 0, 1),
    ("answer_line_only", "7", "Answer: 7", 1, 1, 1),
    ("lowercase_answer", "12", "so the final answer: 12", 1, 1, 1),
    ("last_answer_wins", "4", "Answer: 3\nWait, let me recheck.\nAnswer: 4", 1, 1, 1),
    ("first_answer_loses", "3", "Answer: 3\nWait, let me recheck.\nAnswer: 4", 0, 0, 0),
    # A box and a different "Answer:" line: boxed and math-verify take the box, dapo the line.
    ("box_beats_answer_line", "4", "\\boxed{4}\nAnswer: 5", 1, 0, 1),
    ("answer_line_beats_box", "5", "\\boxed{4}\nAnswer: 5", 0, 1, 0),
    ("answer_beyond_last_300_chars", "7", "Answer: 7\n" + FILLER, 1, 0, 1),
    ("equation", "5", "\\boxed{x = 5}\nAnswer: x = 5", 1, 1, 1),
    # boxed and math-verify read 50% as 50; dapo keeps "50\%".
    ("percent", "50", "\\boxed{50\\%}\nAnswer: 50\\%", 1, 0, 1),
    ("degrees", "90", "\\boxed{90^\\circ}\nAnswer: 90^\\circ", 1, 1, 1),
    ("dollar_sign", "18", "\\boxed{\\$18}\nAnswer: \\$18", 1, 1, 1),
    ("unit_word", "10", "Answer: 10 dollars", 1, 1, 1),
    ("text_answer", "\\text{Monday}", "\\boxed{\\text{Monday}}\nAnswer: Monday", 1, 1, 1),
    # Symbolic equivalence: math-verify only.
    ("sqrt", "2\\sqrt{2}", "\\boxed{\\sqrt{8}}\nAnswer: \\sqrt{8}", 0, 0, 1),
    ("pi", "\\frac{\\pi}{2}", "\\boxed{\\pi/2}\nAnswer: \\pi/2", 0, 0, 1),
    # math-verify rounds floats to 6 digits: 0.333 != 1/3.
    ("rounded_decimal", "\\frac{1}{3}", "\\boxed{0.333}\nAnswer: 0.333", 0, 0, 0),
    ("wrong", "5", "\\boxed{6}\nAnswer: 6", 0, 0, 0),
]


def _per_verifier(table, first_column):
    """One pytest case per (row, verifier); the math_verify ones skip without math-verify."""
    cases = []
    for row in table:
        for column, name in enumerate(VERIFY):
            marks = [requires_math_verify] if name == "math_verify" else []
            args = (name, *row[1:first_column], bool(row[first_column + column]))
            cases.append(pytest.param(*args, marks=marks, id=f"{row[0]}-{name}"))
    return cases


@pytest.mark.parametrize(
    "verifier, ground_truth, completion, correct", _per_verifier(TRICKY, first_column=3)
)
def test_tricky_answers(verifier, ground_truth, completion, correct):
    assert VERIFY[verifier](completion, ground_truth).correct is correct


# (case, completion, well formed for: boxed, dapo, math_verify); the ground truth is "7".
WELL_FORMED = [
    ("boxed", "The answer is \\boxed{7}.", 1, 0, 1),
    ("answer_line", "Answer: 7", 0, 1, 1),  # boxed: a bare number is not an explicit answer
    ("hashes", "the result is #### 7", 1, 0, 1),
    ("answer_beyond_300", "Answer: 7\n" + FILLER, 0, 0, 1),
    ("nothing", "no idea", 0, 0, 0),
]


@pytest.mark.parametrize(
    "verifier, completion, well_formed", _per_verifier(WELL_FORMED, first_column=2)
)
def test_well_formed(verifier, completion, well_formed):
    assert VERIFY[verifier](completion, "7").well_formed is well_formed


@pytest.mark.parametrize(
    "answer, normalized",
    [
        ("x = \\$1,000", "1000"),  # after the last "=", "\$" and spaces gone, commas of digits
        ("5 cm", "5"),
        ("3 units", "3"),
        ("10 dollars", "10"),
        ("90^\\circ", "90"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\dfrac{1}{2}", "\\dfrac{1}{2}"),  # no \dfrac rule
        ("\\text{(B)}", "(B)"),
        ("\\textbf{7}", "7"),
        ("\\boxed{42}", "42"),
        ("The answer is $\\frac{1}{2}$", "\\frac{1}{2}"),  # the first $...$ is kept
        ("-1,000", "-1,000"),  # not all digits: the comma stays
        ("1,2,3", "123"),  # all digits once commas go: a list becomes a number
        ("x=3, y=4", "4"),  # only the text after the last "="
        ("50\\%", "50\\%"),
    ],
)
def test_normalize_dapo_answer(answer, normalized):
    assert normalize_dapo_answer(answer) == normalized


@requires_math_verify
def test_math_verify_off_the_main_thread():
    # math-verify's signal.alarm timeout only works on the main thread; off it we run without.
    results = []
    thread = threading.Thread(
        target=lambda: results.append(verify_math("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}"))
    )
    thread.start()
    thread.join()
    assert [g.correct for g in results] == [True]


def test_rewards_per_verifier(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"question": "q", "answer": "7"}\n{"question": "r", "answer": "8"}\n')
    ds = MathJsonlDataset(path)
    ex = Example(prompt="q", answer="7")
    # (verifier, completions [correct, well formed but wrong, malformed])
    completions = {
        "boxed": ["\\boxed{7}", "\\boxed{6}", "no idea"],
        "dapo": ["Answer: 7", "Answer: 6", "\\boxed{7}"],
        "math_verify": ["\\boxed{7}", "\\boxed{6}", "no idea"],
    }
    native = {"boxed": [1.0, 0.0, 0.0], "dapo": [1.0, -1.0, -1.0], "math_verify": [1.0, 0.0, 0.0]}
    for name, texts in completions.items():
        if name == "math_verify" and importlib.util.find_spec("math_verify") is None:
            continue
        task = MathTask(train=ds, eval=ds[1:], verifier=name, format_reward=0.1, strict=True)
        assert [task.reward(ex, t) for t in texts] == [1.0, 0.1, 0.0], name
        native_task = MathTask(train=ds, eval=ds[1:], verifier=name, native_reward=True)
        assert [native_task.reward(ex, t) for t in texts] == native[name], name
        assert native_task.reward(ex, native_task.demonstration(ex)) == 1.0, name
    with pytest.raises(ValueError, match="verifier must be one of"):
        MathTask(train=ds, eval=ds[1:], verifier="sympy")


def test_missing_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'fp8rl_jax\[math\]'"):
        get_verifier("math_verify")
    assert get_verifier("dapo")("Answer: 7", "7").correct  # the others need nothing extra
