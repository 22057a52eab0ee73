"""Math problems from local files: veRL-style parquet and JSONL through one interface.

A record holds a prompt (a string, or a list of ``{role, content}`` chat messages), a ground truth,
and optionally ``data_source``, ``extra_info`` and ``ability``. Where each lives is configurable
(`DataFields`); dotted names reach into nested fields. veRL's layout (its
``examples/data_preprocess/gsm8k.py`` and the DAPO-Math-17k files) is `VERL_FIELDS`:
``prompt`` = chat messages, ``reward_model.ground_truth``, ``data_source``, ``extra_info``,
``ability``. Errors name the file, the line (JSONL, 1-based) or row (parquet, 0-based), and the
field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fp8rl_jax.tasks.answers import extract_final_answer

DATA_FORMATS = ("auto", "jsonl", "parquet")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_PARQUET_BATCH_ROWS = 1024

Message = Mapping[str, str]  # {"role": "user", "content": "..."}


@dataclasses.dataclass(frozen=True)
class DataFields:
    """Field names of a record; "" = not read. Dotted names are nested ("reward_model.x")."""

    prompt: str = "question"  # a string, or a list of {role, content} chat messages
    ground_truth: str = "answer"  # string or number: a final answer or a solution ending in one
    data_source: str = ""  # string, e.g. "math_dapo" (veRL routes its rewards by it)
    extra_info: str = ""  # object (dict), kept as is
    ability: str = ""  # string, e.g. "MATH"

    def names(self) -> tuple[str, ...]:
        return tuple(
            getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)
        )


VERL_FIELDS = DataFields(
    prompt="prompt",
    ground_truth="reward_model.ground_truth",
    data_source="data_source",
    extra_info="extra_info",
    ability="ability",
)


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One record: the question, its reference solution and final answer, and veRL's metadata."""

    question: str  # the prompt text (chat prompts: the messages' contents joined by blank lines)
    solution: str  # the raw ground-truth field (a GSM8K solution ending in "#### x", or just "x")
    answer: str  # the extracted final answer
    messages: tuple[Message, ...] | None = None  # the chat prompt; None for a string prompt
    data_source: str = ""
    ability: str = ""
    extra_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def prompt(self) -> str | tuple[Message, ...]:
        """What the task's prompt function receives: the question string or the chat messages."""
        return self.question if self.messages is None else self.messages


def resolve_format(path: str, data_format: str = "auto") -> str:
    """ "jsonl" or "parquet": `data_format`, or for "auto" the file's extension."""
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data format must be one of {DATA_FORMATS}, got {data_format!r}")
    if data_format != "auto":
        return data_format
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(
            f"{path}: cannot tell the data format from the extension {ext!r} "
            f"(known: {sorted(_EXTENSIONS)}); set the format to 'jsonl' or 'parquet'"
        )
    return _EXTENSIONS[ext]


class MathDataset(Sequence[MathProblem]):
    """All problems of one JSONL or parquet file, read once and validated."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        data_format: str = "auto",
        fields: DataFields = DataFields(),
    ):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"math dataset file not found: {self.path}")
        self.data_format = resolve_format(self.path, data_format)
        self.fields = fields
        if not fields.prompt or not fields.ground_truth:
            raise ValueError("DataFields.prompt and DataFields.ground_truth must be named")
        records = _read_jsonl if self.data_format == "jsonl" else _read_parquet
        self.problems = tuple(
            problem_from_record(record, fields, where)
            for where, record in records(self.path, fields)
        )
        if not self.problems:
            raise ValueError(f"{self.path}: no records")

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, index):  # noqa: ANN001 (int or slice, as Sequence)
        return self.problems[index]


class MathJsonlDataset(MathDataset):
    """JSONL ``{question_key: str, answer_key: str | number}`` objects, one per line."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        question_key: str = "question",
        answer_key: str = "answer",
    ):
        fields = DataFields(prompt=question_key, ground_truth=answer_key)
        super().__init__(path, data_format="jsonl", fields=fields)


def _read_jsonl(path: str, fields: DataFields) -> Iterator[tuple[str, Mapping[str, Any]]]:
    del fields  # every field of a JSON object is read
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:  # a BOM is allowed at the start of the file only
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                ) from e
            if not line.strip():
                continue
            line = line.rstrip("\r\n")  # else an unclosed object is reported on the next line
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                end = ", the end of the line" if e.pos >= len(line.rstrip()) else ""
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}{end})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def _import_parquet():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise ImportError(
            "reading parquet datasets needs pyarrow: pip install 'fp8rl_jax[data]'"
        ) from e
    return pyarrow, pyarrow.parquet


def _read_parquet(path: str, fields: DataFields) -> Iterator[tuple[str, Mapping[str, Any]]]:
    pa, pq = _import_parquet()
    try:
        parquet_file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file (truncated or corrupt?): {e}") from e
    present = parquet_file.schema_arrow.names
    columns = []
    for name in fields.names():
        column = name if name in present else name.split(".")[0]
        if column not in present:
            raise ValueError(f"{path}: missing field {name!r} (fields present: {sorted(present)})")
        columns.append(column)
    row = 0
    try:
        batches = parquet_file.iter_batches(
            batch_size=_PARQUET_BATCH_ROWS, columns=list(dict.fromkeys(columns))
        )
        for batch in batches:
            for record in batch.to_pylist():
                yield f"{path}: row {row} (0-based)", record
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: corrupt parquet data at row {row} (0-based): {e}") from e


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _lookup(record: Mapping[str, Any], name: str, where: str) -> Any:
    """``record[name]``, or for a dotted name the nested value; errors name the missing part."""
    if name in record:
        return record[name]
    node, parent = record, ""
    for part in name.split("."):
        if not isinstance(node, Mapping):
            raise ValueError(
                f"{where}: field {parent!r} must be an object holding {part!r}, "
                f"got {_type_name(node)}"
            )
        if part not in node:
            inside = f" in {parent!r}" if parent else ""
            raise ValueError(
                f"{where}: missing field {name!r} (fields present{inside}: {sorted(node)})"
            )
        node, parent = node[part], f"{parent}.{part}" if parent else part
    return node


def _prompt(value: Any, name: str, where: str) -> tuple[str, tuple[Message, ...] | None]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field {name!r} is empty")
        return value, None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"{where}: field {name!r} must be a string or a non-empty list of "
            f"{{role, content}} messages, got {_type_name(value)}"
        )
    messages = []
    for i, message in enumerate(value):
        ok = isinstance(message, Mapping) and all(
            isinstance(message.get(key), str) for key in ("role", "content")
        )
        if not ok:
            raise ValueError(
                f"{where}: field {name!r}[{i}] must be a {{role, content}} message with string "
                f"values, got {message!r:.80}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    return "\n\n".join(m["content"] for m in messages), tuple(messages)


def _string_field(record: Mapping[str, Any], name: str, where: str) -> str:
    if not name:
        return ""
    value = _lookup(record, name, where)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, got {_type_name(value)}")
    return value


def problem_from_record(record: Mapping[str, Any], fields: DataFields, where: str) -> MathProblem:
    """One validated problem; the final answer is the last \\boxed{} / "####" answer of the
    ground truth, else the whole stripped ground truth."""
    question, messages = _prompt(_lookup(record, fields.prompt, where), fields.prompt, where)
    solution = _lookup(record, fields.ground_truth, where)
    if isinstance(solution, bool) or not isinstance(solution, str | int | float):
        raise ValueError(
            f"{where}: field {fields.ground_truth!r} must be a string or a number, "
            f"got {_type_name(solution)}"
        )
    solution = str(solution)
    answer = extract_final_answer(solution, fallback_last_number=False) or solution.strip()
    if not answer:
        raise ValueError(f"{where}: field {fields.ground_truth!r} is empty")
    extra_info = _lookup(record, fields.extra_info, where) if fields.extra_info else {}
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise ValueError(
            f"{where}: field {fields.extra_info!r} must be an object, got {_type_name(extra_info)}"
        )
    return MathProblem(
        question=question,
        solution=solution,
        answer=answer,
        messages=messages,
        data_source=_string_field(record, fields.data_source, where),
        ability=_string_field(record, fields.ability, where),
        extra_info=dict(extra_info),
    )


__all__ = [
    "DATA_FORMATS",
    "VERL_FIELDS",
    "DataFields",
    "MathDataset",
    "MathJsonlDataset",
    "MathProblem",
    "Message",
    "problem_from_record",
    "resolve_format",
]
