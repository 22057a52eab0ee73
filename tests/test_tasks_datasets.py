"""Math datasets: veRL-layout parquet and JSONL through one interface, chat prompts, errors."""

import json
import pathlib
import sys

import pytest

from fp8rl_jax.models import load_tokenizer
from fp8rl_jax.tasks import (
    VERL_FIELDS,
    DataFields,
    MathDataset,
    MathJsonlDataset,
    MathTask,
    make_chat_prompt_fn,
)

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    pa = pq = None
requires_pyarrow = pytest.mark.skipif(
    pq is None, reason="pyarrow not installed (pip install 'fp8rl_jax[data]')"
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PARQUET = FIXTURES / "verl" / "dapo_math_tiny.parquet"
JSONL = FIXTURES / "verl" / "dapo_math_tiny.jsonl"
PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def verl_row(question="What is $1 + 1$?", answer="2", **overrides):
    row = {
        "data_source": "math_dapo",
        "prompt": [{"content": question, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "id-0"},
    }
    return row | overrides


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the fixture: veRL's DAPO-Math-17k layout ----------------------------------------------------


@requires_pyarrow
def test_fixture_has_verls_dapo_math_layout():
    schema = pq.read_schema(PARQUET)
    string = pa.string()
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("data_source").type == string and schema.field("ability").type == string
    assert pa.types.is_list(schema.field("prompt").type)
    assert schema.field("prompt").type.value_type == pa.struct(
        [("content", string), ("role", string)]
    )
    assert schema.field("reward_model").type == pa.struct(
        [("ground_truth", string), ("style", string)]
    )
    assert schema.field("extra_info").type == pa.struct([("index", string)])


@requires_pyarrow
def test_reads_verl_parquet():
    ds = MathDataset(PARQUET, fields=VERL_FIELDS)
    assert ds.data_format == "parquet" and len(ds) == 32
    first = ds[0]
    content = PREFIX + "What is $3 + 2$?" + SUFFIX
    assert first.messages == ({"role": "user", "content": content},)
    assert first.question == content and first.prompt == first.messages
    assert (first.solution, first.answer) == ("5", "5")
    assert (first.data_source, first.ability) == ("math_dapo", "MATH")
    assert first.extra_info == {"index": "325dc98d-596e-51bd-875e-ececd6bb34e1"}
    assert [p.answer for p in ds[:4]] == ["5", "-3", "204", "17"]


@requires_pyarrow
def test_parquet_and_jsonl_give_the_same_problems():
    from_parquet = MathDataset(PARQUET, fields=VERL_FIELDS)
    from_jsonl = MathDataset(JSONL, fields=VERL_FIELDS)
    assert from_jsonl.data_format == "jsonl"
    assert from_parquet.problems == from_jsonl.problems


def test_question_answer_jsonl_path_unchanged(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "answer": "so #### 2"}])
    (problem,) = MathDataset(path)  # default fields: question / answer
    assert (problem.question, problem.answer, problem.messages) == ("1+1?", "2", None)
    assert problem.prompt == "1+1?" and problem.data_source == "" and problem.extra_info == {}
    assert MathJsonlDataset(path).problems == (problem,)


@requires_pyarrow
def test_format_from_extension_or_explicit(tmp_path):
    rows = [verl_row()]
    odd = write_parquet(tmp_path / "train.data", rows)
    with pytest.raises(ValueError, match=r"train.data: cannot tell the data format.*'\.data'"):
        MathDataset(odd, fields=VERL_FIELDS)
    assert len(MathDataset(odd, data_format="parquet", fields=VERL_FIELDS)) == 1
    with pytest.raises(ValueError, match="data format must be one of"):
        MathDataset(odd, data_format="csv")
    jsonl_as_parquet = write_jsonl(tmp_path / "rows.parquet", rows)
    with pytest.raises(ValueError, match="not a readable parquet file"):
        MathDataset(jsonl_as_parquet, fields=VERL_FIELDS)
    assert len(MathDataset(jsonl_as_parquet, data_format="jsonl", fields=VERL_FIELDS)) == 1


@requires_pyarrow
def test_field_names_are_configurable(tmp_path):
    rows = [{"meta": {"src": "gsm8k"}, "q": "2+2?", "sol": {"final": 4}, "info": None}]
    fields = DataFields(
        prompt="q", ground_truth="sol.final", data_source="meta.src", extra_info="info"
    )
    for path in (write_jsonl(tmp_path / "a.jsonl", rows), write_parquet(tmp_path / "a.pq", rows)):
        (problem,) = MathDataset(path, fields=fields)
        assert (problem.question, problem.answer, problem.data_source) == ("2+2?", "4", "gsm8k")
        assert problem.extra_info == {}  # null extra_info reads as empty


# --- errors name the file, the line or row, and the field ---------------------------------------

# (row overrides, expected message after "<file>: row 1 (0-based)" / "<file>:2")
BAD_ROWS = [
    (
        {"reward_model": {"style": "rule"}},
        r"missing field 'reward_model.ground_truth' \(fields present in 'reward_model': "
        r"\['style'\]\)",
    ),
    (
        {"reward_model": {"ground_truth": None, "style": "rule"}},
        r"field 'reward_model.ground_truth' must be a string or a number, got null",
    ),
    (
        {"reward_model": {"ground_truth": "  ", "style": "rule"}},
        r"field 'reward_model.ground_truth' is empty",
    ),
    ({"prompt": 7}, r"field 'prompt' must be a string or a non-empty list of .* got int"),
    ({"prompt": []}, r"field 'prompt' must be a string or a non-empty list of .* got list"),
    ({"prompt": [{"content": "q"}]}, r"field 'prompt'\[0\] must be a \{role, content\} message"),
    ({"prompt": "   "}, r"field 'prompt' is empty"),
    ({"data_source": 3}, r"field 'data_source' must be a string, got int"),
    ({"extra_info": "x"}, r"field 'extra_info' must be an object, got str"),
]


@pytest.mark.parametrize("overrides, message", BAD_ROWS)
def test_bad_row_errors_name_line_and_field(tmp_path, overrides, message):
    rows = [verl_row(), verl_row(**overrides)]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: {message}"):
        MathDataset(path, fields=VERL_FIELDS)


@requires_pyarrow
@pytest.mark.parametrize("overrides, message", [*BAD_ROWS[1:3], BAD_ROWS[5]])
def test_bad_row_errors_name_parquet_row_and_field(tmp_path, overrides, message):
    # A parquet column has one type for all rows: the bad rows here are nulls and empty strings
    # (pyarrow fills a missing struct key with null); wrong types are JSONL-only cases.
    path = write_parquet(tmp_path / "bad.parquet", [verl_row(), verl_row(**overrides)])
    with pytest.raises(ValueError, match=rf"bad.parquet: row 1 \(0-based\): {message}"):
        MathDataset(path, fields=VERL_FIELDS)


@requires_pyarrow
def test_parquet_missing_nested_field(tmp_path):
    rows = [verl_row(reward_model={"style": "rule"})] * 2
    path = write_parquet(tmp_path / "nogt.parquet", rows)
    with pytest.raises(
        ValueError,
        match=r"nogt.parquet: row 0 \(0-based\): missing field 'reward_model.ground_truth' "
        r"\(fields present in 'reward_model': \['style'\]\)",
    ):
        MathDataset(path, fields=VERL_FIELDS)


@requires_pyarrow
def test_parquet_missing_column(tmp_path):
    row = verl_row()
    del row["data_source"]
    path = write_parquet(tmp_path / "nocol.parquet", [row])
    with pytest.raises(
        ValueError,
        match=r"nocol.parquet: missing field 'data_source' \(fields present: "
        r"\['ability', 'extra_info', 'prompt', 'reward_model'\]\)",
    ):
        MathDataset(path, fields=VERL_FIELDS)


@requires_pyarrow
def test_empty_files(tmp_path):
    empty_table = pa.Table.from_pylist([verl_row()]).slice(0, 0)
    pq.write_table(empty_table, tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty.parquet: no records"):
        MathDataset(tmp_path / "empty.parquet", fields=VERL_FIELDS)
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"zero.parquet: not a readable parquet file"):
        MathDataset(tmp_path / "zero.parquet", fields=VERL_FIELDS)
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"blank.jsonl: no records"):
        MathDataset(tmp_path / "blank.jsonl")
    with pytest.raises(FileNotFoundError, match="nothing.parquet"):
        MathDataset(tmp_path / "nothing.parquet")


@requires_pyarrow
def test_truncated_and_corrupt_parquet(tmp_path):
    data = PARQUET.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])  # the footer is gone
    with pytest.raises(ValueError, match=r"cut.parquet: not a readable parquet file \(truncated"):
        MathDataset(tmp_path / "cut.parquet", fields=VERL_FIELDS)
    # The footer intact but the prompt column's pages overwritten: fails while reading rows.
    chunk = pq.ParquetFile(PARQUET).metadata.row_group(0).column(1)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    middle = start + chunk.total_compressed_size // 2
    bad = bytearray(data)
    bad[middle : middle + 40] = b"\xff" * 40
    (tmp_path / "rot.parquet").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=r"rot.parquet: corrupt parquet data at row 0 \(0-based\)"):
        MathDataset(tmp_path / "rot.parquet", fields=VERL_FIELDS)


def test_jsonl_not_utf8_names_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    # '{"question": "caf' is 17 characters: the bad byte is in column 18.
    with pytest.raises(
        ValueError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 18\)"
    ):
        MathDataset(path)
    path.write_bytes(b'\xef\xbb\xbf{"question": "q", "answer": "1"}\n')  # a UTF-8 BOM is fine
    assert MathDataset(path)[0].question == "q"


def test_missing_pyarrow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'fp8rl_jax\[data\]'"):
        MathDataset(PARQUET, fields=VERL_FIELDS)


# --- chat prompts --------------------------------------------------------------------------------


def test_chat_messages_go_through_the_chat_template():
    tokenizer = load_tokenizer(FIXTURES / "hf" / "tokenizer")
    ds = MathDataset(JSONL, fields=VERL_FIELDS)
    task = MathTask(train=ds, eval_fraction=0.25, prompt_fn=make_chat_prompt_fn(tokenizer))
    example = task.sample(0)
    problem = next(p for p in ds if p.question == example.meta["question"])
    # The messages carry DAPO's own instruction: the template wraps them as they are.
    want = f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n"
    assert example.prompt == want
    assert example.answer == problem.answer and example.meta["data_source"] == "math_dapo"
    with pytest.raises(ValueError, match=r"needs a chat template.*make_chat_prompt_fn"):
        MathTask(train=ds, eval_fraction=0.25).sample(0)


# --- the config path: TaskSpec -> build_task ----------------------------------------------------


@requires_pyarrow
def test_build_task_from_a_verl_parquet_file():
    from fp8rl_jax.train.experiment import TaskSpec, TrainerConfig
    from fp8rl_jax.train.setup import build_task

    spec = TaskSpec(
        name="math",
        jsonl_path=str(PARQUET),
        question_key="prompt",
        answer_key="reward_model.ground_truth",
        data_source_key="data_source",
        extra_info_key="extra_info",
        verifier="dapo",
        native_reward=True,
        tokenizer_path=str(FIXTURES / "hf" / "tokenizer"),
    )
    task, _ = build_task(spec)
    assert task.num_examples("train") + task.num_examples("eval") == 32
    example = task.sample(0)
    assert example.prompt.startswith("<|im_start|>user\nSolve the following math problem")
    assert example.meta["data_source"] == "math_dapo"
    assert task.reward(example, f"...\nAnswer: {example.answer}") == 1.0
    assert task.reward(example, "\\boxed{0.5}") == -1.0  # dapo needs "Answer:"
    with pytest.raises(ValueError, match="TaskSpec.verifier must be one of"):
        TaskSpec(verifier="exact")
    with pytest.raises(ValueError, match="TaskSpec.data_format must be one of"):
        TaskSpec(data_format="csv")
    with pytest.raises(ValueError, match="trainer.loggers must include 'jsonl'"):
        TrainerConfig(loggers=("wandb",))
    assert TrainerConfig(loggers=("jsonl", "wandb")).loggers == ("jsonl", "wandb")
