"""Built-in tasks: determinism, train/eval split, rewards, countdown verifier, batching."""

import numpy as np
import pytest

from fp8rl_jax.tasks import (
    TASKS,
    CharTokenizer,
    CountdownTask,
    Example,
    get_task,
    grade_countdown,
    in_eval_split,
    make_demonstration_batch,
    make_prompt_batch,
    parse_arithmetic,
    score_completions,
)

GENERATED = ["addition", "multiplication", "countdown", "reverse", "sort", "chain"]


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert tok.vocab_size <= 64
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "12+34=46 rev:9,8;(3*4)-1/2"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert min(ids[1:-1]) >= 3
    assert tok.decode(ids) == text
    # decode stops at the first EOS and drops padding.
    assert tok.decode([0, 0, *tok.encode("46"), tok.eos_id, *tok.encode("99")]) == "46"
    assert tok.decode([*tok.encode("4"), tok.eos_id, *tok.encode("5")], stop_at_eos=False) == "45"
    assert tok.decode_batch(np.array([[*tok.encode("7"), 2, 9], [*tok.encode("88"), 2]])) == [
        "7",
        "88",
    ]


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"'A' at position 2"):
        CharTokenizer().encode("12A")


def test_every_task_prompt_and_demonstration_is_encodable():
    tok = CharTokenizer()
    for name in GENERATED:
        task = get_task(name)
        for split in ("train", "eval"):
            ex = task.sample(3, split)
            assert tok.decode(tok.encode(ex.prompt + task.demonstration(ex))) == (
                ex.prompt + task.demonstration(ex)
            )


# --- determinism and split ---------------------------------------------------------------------


@pytest.mark.parametrize("name", GENERATED)
def test_sampling_is_deterministic_by_seed(name):
    a, b, c = get_task(name, seed=7), get_task(name, seed=7), get_task(name, seed=8)
    prompts_a = [a.sample(i).prompt for i in range(20)]
    assert prompts_a == [b.sample(i).prompt for i in range(20)]
    assert prompts_a != [c.sample(i).prompt for i in range(20)]
    # Random access: example i does not depend on having drawn examples < i.
    assert get_task(name, seed=7).sample(13) == a.sample(13)


@pytest.mark.parametrize("name", GENERATED)
def test_train_and_eval_are_disjoint(name):
    task = get_task(name, seed=0)
    train = {task.problem_key(task.sample(i, "train")) for i in range(300)}
    evals = {task.problem_key(task.sample(i, "eval")) for i in range(60)}
    assert train and evals and not train & evals
    # The partition is a fixed function of the problem, the same for every seed.
    other = get_task(name, seed=123)
    assert not {other.problem_key(other.sample(i, "train")) for i in range(300)} & evals


def test_eval_fraction_is_roughly_respected():
    keys = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    frac = np.mean([in_eval_split(k, 0.1) for k in keys])
    assert 0.08 < frac < 0.12


def test_bad_split_and_config_are_rejected():
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("addition").sample(0, "test")
    with pytest.raises(ValueError, match="digits"):
        get_task("addition", digits=0)
    with pytest.raises(ValueError, match="unknown task 'adition'"):
        get_task("adition")
    assert set(GENERATED) | {"math"} == set(TASKS)


# --- rewards -----------------------------------------------------------------------------------


def test_addition_rewards_on_hand_written_completions():
    task = get_task("addition", format_reward=0.1)
    ex = Example(prompt="12+34=", answer="46")
    assert task.reward(ex, "46") == 1.0
    assert task.reward(ex, " 46 ") == 1.0  # surrounding whitespace is ignored
    assert task.reward(ex, "47") == pytest.approx(0.1)  # well-formed but wrong
    assert task.reward(ex, "46abc") == 0.0  # malformed (trailing junk)
    assert task.reward(ex, "") == 0.0
    assert get_task("addition", format_reward=0.0).reward(ex, "47") == 0.0


def test_reverse_and_sort_rewards():
    rev, srt = get_task("reverse"), get_task("sort")
    ex = Example(prompt="rev:120=", answer="021")
    assert rev.reward(ex, "021") == 1.0
    assert rev.reward(ex, "012") == pytest.approx(0.1)
    assert rev.reward(ex, "21") == 0.0  # wrong length is malformed
    ex = Example(prompt="sort:312=", answer="123")
    assert srt.reward(ex, "123") == 1.0 and srt.reward(ex, "1 2 3") == 0.0


def test_generated_demonstrations_get_full_reward():
    for name in GENERATED:
        task = get_task(name)
        for i in range(30):
            ex = task.sample(i)
            assert task.reward(ex, task.demonstration(ex)) == 1.0, (name, ex)


# --- countdown verifier ------------------------------------------------------------------------


def test_parse_arithmetic_precedence_and_parentheses():
    assert parse_arithmetic("3*5+7").value == 22
    assert parse_arithmetic("3*(5+7)").value == 36
    assert parse_arithmetic("10-4-3").value == 3  # left associative
    assert parse_arithmetic(" 2 * 3 ").literals == (2, 3)
    for bad in ["", "3+", "3++4", "(3+4", "3+4)", "-3+4", "3^2", "__import__('os')", "3 4"]:
        with pytest.raises(ValueError):
            parse_arithmetic(bad)
    with pytest.raises(ValueError, match="longer than"):
        parse_arithmetic("1+" * 40 + "1")
    with pytest.raises(ValueError, match="nested deeper"):
        parse_arithmetic("(" * 20 + "1" + ")" * 20)


def test_countdown_verifier_edge_cases():
    nums, target = (3, 5, 7), 22
    assert grade_countdown("3*5+7", nums, target).correct
    assert grade_countdown("7+5*3", nums, target).correct  # any order
    assert grade_countdown("(3)*(5)+(7)", nums, target).correct
    reuse = grade_countdown("7+7+5+3", nums, target)  # 7 used twice
    assert not reuse.correct and reuse.well_formed
    foreign = grade_countdown("2*11", nums, target)  # numbers not given
    assert not foreign.correct and foreign.well_formed
    assert grade_countdown("5*3+7", (3, 5, 7, 7), 22).correct  # a subset is enough
    assert grade_countdown("7+7+5+3", (3, 5, 7, 7), 22).correct  # duplicates given twice
    wrong = grade_countdown("3+5+7", nums, target)
    assert not wrong.correct and wrong.well_formed
    assert not grade_countdown("3*5+", nums, target).well_formed
    # Division: off by default (malformed); when on, exact rationals and x/0 is never correct.
    assert not grade_countdown("6/3", (6, 3), 2).well_formed
    assert grade_countdown("6/3", (6, 3), 2, allow_division=True).correct
    non_integer = grade_countdown("7/2", (7, 2), 3, allow_division=True)
    assert not non_integer.correct and non_integer.well_formed
    assert grade_countdown("(7/2)*2", (7, 2, 2), 7, allow_division=True).correct
    by_zero = grade_countdown("4/(2-2)", (4, 2, 2), 0, allow_division=True)
    assert not by_zero.correct and by_zero.well_formed
    assert parse_arithmetic("4/(2-2)", allow_division=True).value is None


def test_countdown_task_rewards():
    task = CountdownTask(num_numbers=3, max_number=10, format_reward=0.1)
    ex = task.sample(0)
    numbers, target = ex.meta["numbers"], ex.meta["target"]
    assert ex.prompt == f"{','.join(map(str, numbers))};{target}="
    assert task.reward(ex, ex.answer) == 1.0
    # The bare target is well-formed; it is only correct when the target is one of the numbers.
    assert task.reward(ex, f"{target}") == pytest.approx(1.0 if target in numbers else 0.1)
    assert task.reward(ex, "what") == 0.0


# --- batching ----------------------------------------------------------------------------------


def test_make_prompt_batch_groups_and_left_padding():
    tok, task = CharTokenizer(), get_task("addition", digits=2)
    batch = make_prompt_batch(task, tok, [0, 1, 2], group_size=4, pad_to=12)
    assert batch.tokens_BP.shape == (12, 12) and batch.tokens_BP.dtype == np.int32
    assert [ex.prompt for ex in batch.examples[:4]] == [task.sample(0).prompt] * 4
    assert batch.examples[4] == task.sample(1)
    for b, ex in enumerate(batch.examples):
        n = batch.lens_B[b]
        assert n == len(ex.prompt) + 1  # + BOS
        assert (batch.tokens_BP[b, : 12 - n] == tok.pad_id).all()
        assert batch.tokens_BP[b, 12 - n] == tok.bos_id
        assert tok.decode(batch.tokens_BP[b]) == ex.prompt
    with pytest.raises(ValueError, match="does not fit pad_to=3"):
        make_prompt_batch(task, tok, [0], group_size=1, pad_to=3)
    eval_batch = make_prompt_batch(task, tok, [0], group_size=1, split="eval", add_bos=False)
    assert eval_batch.examples[0] == task.sample(0, "eval")
    assert eval_batch.tokens_BP[0, 0] != tok.bos_id


def test_make_demonstration_batch():
    tok, task = CharTokenizer(), get_task("countdown")
    demo = make_demonstration_batch(task, tok, [0, 1], pad_to=16, completion_len=12)
    assert demo.completion_tokens_BT.shape == (2, 12)
    for b in range(2):
        ex = task.sample(b)
        n = int(demo.completion_mask_BT[b].sum())
        assert tok.decode(demo.completion_tokens_BT[b]) == ex.answer
        assert demo.completion_tokens_BT[b, n - 1] == tok.eos_id
        assert (demo.completion_tokens_BT[b, n:] == tok.pad_id).all()


def test_score_completions():
    tok, task = CharTokenizer(), get_task("addition")
    batch = make_prompt_batch(task, tok, [0, 1], group_size=2)
    answers = [ex.answer for ex in batch.examples]
    texts = [answers[0], str(int(answers[1]) + 1), "oops", answers[3]]
    rewards_B, accuracy = score_completions(task, batch.examples, texts)
    assert rewards_B.dtype == np.float32
    np.testing.assert_allclose(rewards_B, [1.0, 0.1, 0.0, 1.0])
    assert accuracy == 0.5
    with pytest.raises(ValueError, match="2 examples but 1 completions"):
        score_completions(task, batch.examples[:2], ["1"])


def test_bos_is_added_once_and_only_if_the_tokenizer_has_one():
    class NoBos(CharTokenizer):
        bos_id = None

    class TemplateWithBos(CharTokenizer):
        def encode(self, text, **kw):
            return [self.bos_id, *super().encode(text, **kw)]

    task = get_task("addition")
    n = len(task.sample(0).prompt)
    assert make_prompt_batch(task, NoBos(), [0], 1).lens_B[0] == n
    assert make_prompt_batch(task, TemplateWithBos(), [0], 1).lens_B[0] == n + 1
    assert make_prompt_batch(task, CharTokenizer(), [0], 1).lens_B[0] == n + 1
