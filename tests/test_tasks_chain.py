"""The long-response chain task: hand-computed prompts, answers, grades and lengths."""

import pytest

from fp8rl_jax.tasks import ChainTask, CharTokenizer, chain_answer, get_task
from fp8rl_jax.tasks.chain import right_steps
from fp8rl_jax.train.experiment import TaskSpec
from fp8rl_jax.train.setup import build_task


def test_chain_answer_by_hand():
    assert chain_answer(23, 7, 3) == "016,009,002"
    assert chain_answer(21, 7, 3) == "014,007,000"
    assert chain_answer(5, 1, 2) == "04,03,02,01,00"
    assert chain_answer(6, 7, 3) == ""  # no subtraction stays >= 0


def test_chain_grade_by_hand():
    task = ChainTask(min_steps=3, max_steps=3)
    ex = task.sample(0)
    n, k = ex.meta["n"], ex.meta["k"]
    assert ex.prompt == f"ch:{n:03d}-{k}="
    assert ex.meta["steps"] == 3 and 3 * k <= n < 4 * k
    assert ex.answer == ",".join(f"{n - i * k:03d}" for i in (1, 2, 3))
    assert task.reward(ex, ex.answer) == 1.0
    assert task.reward(ex, f" {ex.answer}\n") == 1.0  # surrounding whitespace is ignored
    wrong = ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)
    g = task.grade(ex, wrong)
    assert not g.correct and g.well_formed
    assert not task.grade(ex, ex.answer[:-1]).well_formed  # a 2-digit last value
    assert not task.grade(ex, ex.answer + ",").well_formed
    fmt = ChainTask(min_steps=3, max_steps=3, format_reward=0.25)
    assert fmt.reward(ex, wrong) == 0.25 and fmt.reward(ex, "12") == 0.0


def test_chain_lengths_follow_the_steps_knob():
    task = ChainTask(min_steps=10, max_steps=20, width=3, max_stride=4)
    tok = CharTokenizer()
    lengths = []
    for i in range(200):
        ex = task.sample(i)
        steps = ex.meta["steps"]
        assert 10 <= steps <= 20 and 1 <= ex.meta["k"] <= 4
        assert len(ex.answer) == task.response_length(steps) == 4 * steps - 1
        assert len(tok.encode(ex.prompt + ex.answer)) == 9 + 4 * steps - 1  # encodable
        lengths.append(len(ex.answer))
    assert min(lengths) == 39 and max(lengths) == 79


def test_chain_rejects_bad_knobs():
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        ChainTask(min_steps=5, max_steps=4)
    with pytest.raises(ValueError, match="max_stride"):
        ChainTask(max_stride=10)
    with pytest.raises(ValueError, match="does not fit"):
        ChainTask(max_steps=200, max_stride=9, width=3)  # 201 * 9 > 999


def test_chain_from_task_spec():
    task, _ = build_task(TaskSpec(name="chain", min_steps=4, max_steps=6, max_stride=2), "")
    assert isinstance(task, ChainTask) and (task.min_steps, task.max_steps) == (4, 6)
    assert task.max_stride == 2
    assert get_task("chain").max_steps == 75


def test_right_steps_by_hand():
    # ch:037-8= -> 029,021,013,005
    assert right_steps("029,021,013,005", 37, 8, 3, 4) == 4
    assert right_steps("029,022,014,005", 37, 8, 3, 4) == 2  # 022 wrong, 014 = 022 - 8 right
    assert right_steps("028,020,012,004", 37, 8, 3, 4) == 3  # only the first step is wrong
    assert right_steps("029,21,013,005", 37, 8, 3, 4) == 2  # "21" is no value; 013 has no base
    assert right_steps("029,021,013,005,-03", 37, 8, 3, 4) == 4  # past the answer: ignored
    assert right_steps("", 37, 8, 3, 4) == 0


def test_chain_partial_credit_by_hand():
    task = ChainTask(min_steps=4, max_steps=4, partial_credit=0.5, format_reward=0.1)
    ex = task.sample(0)
    n, k = ex.meta["n"], ex.meta["k"]
    values = ex.answer.split(",")  # 4 values
    one_slip = ",".join([values[0], f"{n - 2 * k + 1:03d}", f"{n - 3 * k + 1:03d}", values[3]])
    g = task.grade(ex, one_slip)  # steps 1 and 4 wrong, 2 and 3 right
    assert not g.correct and g.well_formed and g.steps == 0.5
    assert task.reward(ex, one_slip) == 0.5 * 0.5
    assert task.reward(ex, ",".join(values[:3])) == 0.5 * 0.75  # stopped one value early
    assert task.reward(ex, "999") == 0.1  # no right step: the format reward
    assert task.reward(ex, ex.answer + ",000") == 0.5  # all values then one too many: not correct
    assert task.reward(ex, ex.answer) == 1.0
    assert ChainTask(format_reward=0.0).reward(ex, one_slip) == 0.0  # partial_credit=0
    with pytest.raises(ValueError, match="partial_credit"):
        ChainTask(partial_credit=1.0)
