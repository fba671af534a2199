"""The suites' data, as plain dicts, from the course's files or the hub.

- MMLU: a directory with ``{split}/<subject>_{split}.csv`` (no header; ``question, A, B, C, D,
  answer_letter``; the subject is the file name with ``_`` as spaces), or the hub id ``cais/mmlu``.
  Rows: ``{subject, question, options: [4], answer: "A".."D"}``, subjects in alphabetical order.
- GSM8K: whatever ``rlvr.task.data.load_examples`` reads (a JSONL file, a directory with
  ``{split}.jsonl``, ``openai/gsm8k``). Rows: ``{question, answer}`` (the final answer only).
- AlpacaEval: the JSON array of ``{dataset, instruction, output, generator}`` (``output`` is the
  reference answer), or a directory holding ``alpaca_eval_gpt4_turbo.json``.
- SimpleSafetyTests: the CSV ``id, harm_area, counter, category, prompts_final``, or a directory
  holding ``simple_safety_tests.csv``.

A missing file is an error that says what was expected where.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rlvr.task.data import DataError, load_examples

MMLU_LETTERS = ("A", "B", "C", "D")
ALPACA_EVAL_FILE = "alpaca_eval_gpt4_turbo.json"
SST_FILE = "simple_safety_tests.csv"


def _is_hub_id(source: str) -> bool:
    return not Path(source).exists() and source.count("/") == 1 and not source.startswith((".", "/", "~"))


def load_mmlu(source: str | Path, split: str = "test", limit: int | None = None) -> list[dict]:
    source = str(source)
    if _is_hub_id(source):
        return _load_mmlu_hub(source, split, limit)
    root = Path(source)
    folder = root / split if (root / split).is_dir() else root
    files = sorted(folder.glob(f"*_{split}.csv"))
    if not files:
        raise DataError(
            f"no MMLU files {folder}/<subject>_{split}.csv; pass the MMLU directory "
            "(with dev/, val/, test/) or the hub id cais/mmlu"
        )
    rows: list[dict] = []
    for path in files:
        subject = path.name[: -len(f"_{split}.csv")].replace("_", " ")
        with path.open(encoding="utf-8", newline="") as f:
            for lineno, rec in enumerate(csv.reader(f), start=1):
                if len(rec) != 6 or rec[5].strip() not in MMLU_LETTERS:
                    raise DataError(f"{path}:{lineno}: expected 6 columns (question, A, B, C, D, answer letter A-D)")
                rows.append({"subject": subject, "question": rec[0], "options": rec[1:5], "answer": rec[5].strip()})
                if limit is not None and len(rows) >= limit:
                    return rows
    return rows


def _load_mmlu_hub(name: str, split: str, limit: int | None) -> list[dict]:
    import datasets

    ds = datasets.load_dataset(name, "all", split=split)
    rows = [
        {
            "subject": r["subject"].replace("_", " "),
            "question": r["question"],
            "options": list(r["choices"]),
            "answer": MMLU_LETTERS[int(r["answer"])],
        }
        for r in ds
    ]
    rows.sort(key=lambda r: r["subject"])  # the files' order: subjects alphabetically, questions in order
    return rows[:limit] if limit is not None else rows


def load_gsm8k(source: str | Path, split: str = "test", limit: int | None = None) -> list[dict]:

    return [{"question": ex.question, "answer": ex.ground_truth} for ex in load_examples(str(source), split, limit)]


def _file_in(source: str | Path, filename: str, what: str) -> Path:
    path = Path(source)
    if path.is_dir():
        path = path / filename
    if not path.is_file():
        raise DataError(f"{what}: {path} not found; pass the file ({filename}) or its directory")
    return path


def load_alpaca_eval(source: str | Path, limit: int | None = None) -> list[dict]:
    path = _file_in(source, ALPACA_EVAL_FILE, "AlpacaEval")
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and isinstance(r.get("instruction"), str) for r in rows
    ):
        raise DataError(f"{path}: expected a JSON array of objects with an 'instruction' (and reference 'output')")
    return rows[:limit] if limit is not None else rows


def load_sst(source: str | Path, limit: int | None = None) -> list[dict]:
    path = _file_in(source, SST_FILE, "SimpleSafetyTests")
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "prompts_final" not in rows[0]:
        raise DataError(f"{path}: expected a CSV with a 'prompts_final' column, got {list(rows[0])}")
    return rows[:limit] if limit is not None else rows
