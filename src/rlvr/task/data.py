"""Tasks as lists of ``Example(question, ground_truth)``: from local files, the hub, or a registered task.

A source is one of:

- a local file: JSONL (one object per line), JSON (an array of objects, or an object holding one),
  Parquet or CSV;
- a local folder holding the split's file (``{split}.jsonl``, ``{split}.parquet``, ...; also
  ``{split}-00000-of-00001.parquet`` shards, as the hub stores them, directly or under ``data/``);
- a hub dataset id (``owner/name``) read through ``datasets`` with a config (``data.config``) and a split;
- a registered task ``name`` / ``name:key=value,...`` (see ``rlvr.task.generated``).

Rows become examples through a ``RowFormat``: ``question_field`` names the question column,
``answer_field`` the answer column, and ``answer_format`` says how the ground truth comes out of the
answer: ``gsm8k`` (the text after the last ``####``, stripped; it may keep thousands commas such as
``2,125``, which the grader ignores), ``boxed`` (the content of the last ``\\boxed{...}``, as in MATH
solutions) or ``raw`` (the whole answer, stripped; numbers become text). Every other column is kept
in ``Example.meta`` and reaches the reward function as keyword arguments.

The question column may hold a conversation instead of a string: a list of ``{role, content}``
messages (system, few-shot turns, user), a *chat row*. It is rendered with the model's chat template
(the ``chat`` prompt) and ends with the generation prompt of the assistant's turn.

A malformed row is an error that names the file and the line (the row for Parquet and the hub):
nothing is skipped silently.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr.task import generated
from rlvr.task.chat import check_messages
from rlvr.task.example import DataError, Example
from rlvr.task.grading import last_boxed

ANSWER_FORMATS = ("gsm8k", "boxed", "raw")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class RowFormat:
    """How a row (a mapping of column to value) becomes an ``Example``."""

    question_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "gsm8k"
    option_prefix: str = "data."
    """How the caller spells these options in messages: ``data.`` (a training config) or ``--`` (``rlvr sft``)."""

    def option(self, name: str) -> str:
        """The caller's name of option ``name`` (``data.question_field``, ``--question-field``)."""
        return self.option_prefix + (name.replace("_", "-") if self.option_prefix == "--" else name)

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise DataError(
                f"unknown {self.option('answer_format')} {self.answer_format!r}: choose one of "
                f"{', '.join(ANSWER_FORMATS)}"
            )

    def example(self, row: Any, where: str) -> Example:
        """The example of ``row``; ``DataError`` starting with ``where`` for a row that does not fit."""
        q, a = self.question_field, self.answer_field
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: expected an object with string fields {q!r} and {a!r}, got a {type(row).__name__}"
            )
        missing = [name for name in (q, a) if name not in row]
        if missing:
            setting = {q: self.option("question_field"), a: self.option("answer_field")}
            raise DataError(
                f"{where}: expected an object with string fields {q!r} and {a!r}; no column {missing[0]!r} "
                f"(columns: {', '.join(map(str, row)) or 'none'}); set {setting[missing[0]]} to one of them"
            )
        question, answer = row[q], row[a]
        messages = None
        if isinstance(question, list):  # a chat row: the conversation that the model answers
            messages = tuple(check_messages(question, f"{where}, column {q!r}"))
            users = [m["content"] for m in messages if m["role"] == "user"]
            question = users[-1] if users else messages[-1]["content"]
        raw_number = self.answer_format == "raw" and isinstance(answer, (int, float)) and not isinstance(answer, bool)
        if not isinstance(question, str) or not (isinstance(answer, str) or raw_number):
            raise DataError(
                f"{where}: expected an object with string fields {q!r} and {a!r}, got "
                f"{type(question).__name__} and {type(answer).__name__}"
            )
        meta = {k: v for k, v in row.items() if k not in (q, a)}
        if raw_number:
            answer = str(answer)
        if self.answer_format == "gsm8k":
            if "####" not in answer:
                raise DataError(
                    f"{where}: the answer has no '####' marker before its final answer "
                    "(for other answers set data.answer_format to boxed or raw)"
                )
            truth, solution = extract_gsm8k_answer(answer), _rationale(answer)
            if not truth:
                raise DataError(f"{where}: the final answer after '####' is empty")
            return Example(question, truth, solution, meta, messages)
        if self.answer_format == "boxed":
            boxed = last_boxed(answer)
            if not boxed or not boxed.strip():
                raise DataError(
                    f"{where}: the answer has no \\boxed{{...}} with a final answer "
                    "(for other answers set data.answer_format to gsm8k or raw)"
                )
            return Example(question, boxed.strip(), answer, meta, messages)
        truth = answer.strip()
        if not truth:
            raise DataError(f"{where}: the answer in column {a!r} is empty")
        return Example(question, truth, None, meta, messages)


GSM8K_FORMAT = RowFormat()


def extract_gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K rationale: the text after the last ``####``, stripped."""
    if "####" not in answer:
        raise DataError("the answer has no '####' marker before its final answer")
    return answer.rsplit("####", 1)[1].strip()


def _rationale(answer: str) -> str:
    body = answer.rsplit("####", 1)[0].strip()
    # GSM8K annotates calculator calls as <<48/2=24>>; they are not part of the written reasoning.
    return re.sub(r"<<[^>]*>>", "", body)


# -- local files ----------------------------------------------------------------------------------


def _jsonl_rows(path: Path) -> Iterator[tuple[Any, str]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield json.loads(line), where
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None


def _json_rows(path: Path) -> Iterator[tuple[Any, str]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}: not valid JSON ({e.msg}); a .json file holds one array of objects "
            "(for one object per line, name the file .jsonl)"
        ) from None
    if isinstance(data, dict):  # {"data": [...]} or {"rows": [...]}: the one list it holds
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON array of objects (or an object holding one array)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
    # The line where each item starts, so that an error names it (only for a top-level array).
    starts = _item_lines(text) if text.lstrip().startswith("[") else []
    if len(starts) != len(data):  # scalars among the items: count items instead
        starts = []
    for i, row in enumerate(data):
        yield row, f"{path}:{starts[i]}" if starts else f"{path}: item {i + 1}"


def _item_lines(text: str) -> list[int]:
    """Line numbers where the objects and arrays directly inside a top-level JSON array start."""
    lines: list[int] = []
    depth, lineno, in_string, escaped = 0, 1, False, False
    for ch in text:
        if ch == "\n":
            lineno += 1
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 2:
                lines.append(lineno)
        elif ch in "]}":
            depth -= 1
    return lines


def _parquet_rows(path: Path) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 (pyarrow raises several types for a broken file)
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield row, f"{path}: row {i + 1}"


def _csv_rows(path: Path) -> Iterator[tuple[Any, str]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:
                raise DataError(f"{where}: more values than the header has columns")
            yield row, where


_READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows, ".csv": _csv_rows}


def load_file(path: str | Path, limit: int | None = None, fmt: RowFormat = GSM8K_FORMAT) -> list[Example]:
    """Examples from one local JSONL, JSON, Parquet or CSV file (by its suffix)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"{path}: no such file; pass a JSONL, JSON, Parquet or CSV file, a folder of them, "
            "or a hub dataset id such as 'openai/gsm8k'"
        )
    reader = _READERS.get(path.suffix.lower(), _jsonl_rows)
    examples: list[Example] = []
    if limit is not None and limit <= 0:
        return examples
    try:
        for row, where in reader(path):
            examples.append(fmt.example(row, where))
            if limit is not None and len(examples) >= limit:
                break
    except UnicodeDecodeError as e:
        raise DataError(not_utf8(path, e)) from None
    return examples


def not_utf8(path: Path, e: UnicodeDecodeError) -> str:
    """The one-line message of a data file that is not UTF-8 text."""
    return f"{path}: not UTF-8 text (it holds the byte {e.object[e.start : e.start + 1]!r}); save the file as UTF-8"


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read GSM8K-style JSONL. Raises ``DataError`` naming file and line for any malformed row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a GSM8K JSONL file or the hub id 'openai/gsm8k'")
    return load_file(path, limit, GSM8K_FORMAT)


def split_files(folder: Path, split: str) -> list[Path]:
    """The files of ``split`` in ``folder``: ``{split}.<ext>``, else its shards ``{split}-*.<ext>``
    (directly or under ``data/``)."""
    for suffix in FILE_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return [folder / f"{split}{suffix}"]
    for where in (folder, folder / "data"):
        for suffix in FILE_SUFFIXES:
            shards = sorted(where.glob(f"{split}-*{suffix}"))
            if shards:
                return shards
    return []


def _splits_in(folder: Path) -> list[str]:
    names = set()
    for where in (folder, folder / "data"):
        for p in where.glob("*"):
            if p.suffix.lower() in FILE_SUFFIXES:
                names.add(re.split(r"-\d", p.stem, maxsplit=1)[0])
    return sorted(names)


# -- the hub --------------------------------------------------------------------------------------


def load_hub(
    name: str, split: str, limit: int | None = None, config: str | None = None, fmt: RowFormat = GSM8K_FORMAT
) -> list[Example]:
    """A hub dataset through ``datasets`` (needs network access or the ``datasets`` cache)."""
    import datasets

    if config is None and name == "openai/gsm8k":
        config = "main"
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except ValueError as e:  # an unknown config or split: datasets names the ones there are
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"hub dataset {name} (config {config}, split {split}): {first}; set data.config or the split"
        ) from None
    except (OSError, ConnectionError) as e:  # not found, or no network
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"hub dataset {name} could not be loaded ({type(e).__name__}: {first}); check the id and your "
            "network, or give a local file"
        ) from None
    out = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        out.append(fmt.example(row, f"{name} [{split}] row {i + 1}"))
    return out


def _looks_like_hub_id(source: str) -> bool:
    """``owner/name`` with no further path parts, not starting like a local path."""
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~")) and not Path(parts[0]).exists()


# -- any source -----------------------------------------------------------------------------------


def load_examples(
    source: str,
    split: str = "train",
    limit: int | None = None,
    seed: int = 0,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    answer_format: str = "gsm8k",
    config: str | None = None,
    option_prefix: str = "data.",
) -> list[Example]:
    """Load a task by source (see the module docstring); the field and format arguments say how rows
    become examples (they do not apply to registered tasks, which build their examples themselves)."""
    if generated.is_task_spec(source):
        return generated.load_task(source, split=split, limit=limit, seed=seed)
    fmt = RowFormat(question_field, answer_field, answer_format, option_prefix)
    p = Path(source)
    if p.is_dir():
        files = split_files(p, split)
        if not files:
            present = _splits_in(p)
            raise DataError(
                f"{source} has no {split} file ({split}.jsonl, .json, .parquet or .csv; splits there: "
                f"{', '.join(present) or 'none'}); choose one of those splits or another data folder"
            )
        examples: list[Example] = []
        for f in files:
            examples += load_file(f, None if limit is None else limit - len(examples), fmt)
            if limit is not None and len(examples) >= limit:
                break
        return examples
    if p.suffix.lower() in FILE_SUFFIXES or p.exists():
        return load_file(p, limit, fmt)
    if _looks_like_hub_id(source):
        return load_hub(source, split, limit, config, fmt)
    raise DataError(
        f"cannot load data from {source!r}: give a JSONL, JSON, Parquet or CSV file, a folder with the {split} split, "
        f"a hub dataset id such as 'openai/gsm8k', or a task name from rlvr.task.generated ({', '.join(generated.TASKS)})"
    )
