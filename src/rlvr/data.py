"""Tasks as lists of ``Example(question, ground_truth)``: GSM8K from a JSONL file or the hub.

GSM8K rows are ``{"question": str, "answer": str}``; the ground truth is the text after the last
``####`` of the answer, stripped (it may keep thousands commas such as ``2,125``; the grader ignores
them). A malformed line is an error that names the file and the line: nothing is skipped silently.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from rlvr.errors import UserError


@dataclass(frozen=True)
class Example:
    question: str
    ground_truth: str
    solution: str | None = None
    """A worked solution when the source has one (GSM8K rationales), for supervised warm starts."""
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class DataError(UserError, ValueError):
    """Malformed task data."""


def extract_gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K rationale: the text after the last ``####``, stripped."""
    if "####" not in answer:
        raise DataError("the answer has no '####' marker before its final answer")
    return answer.rsplit("####", 1)[1].strip()


def _rationale(answer: str) -> str:
    body = answer.rsplit("####", 1)[0].strip()
    # GSM8K annotates calculator calls as <<48/2=24>>; they are not part of the written reasoning.
    import re

    return re.sub(r"<<[^>]*>>", "", body)


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read GSM8K-style JSONL. Raises ``DataError`` naming file and line for any malformed row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a GSM8K JSONL file or the hub id 'openai/gsm8k'")
    examples: list[Example] = []
    if limit is not None and limit <= 0:
        return examples
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                raise DataError(f"{where}: expected an object with string fields 'question' and 'answer'")
            try:
                truth = extract_gsm8k_answer(row["answer"])
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if not truth:
                raise DataError(f"{where}: the final answer after '####' is empty")
            examples.append(Example(row["question"], truth, _rationale(row["answer"])))
            if limit is not None and len(examples) >= limit:
                break
    return examples


def load_gsm8k_hub(split: str, limit: int | None = None, name: str = "openai/gsm8k", config: str = "main") -> list[Example]:
    """GSM8K from the Hugging Face hub through ``datasets`` (needs network access)."""
    import datasets

    ds = datasets.load_dataset(name, config, split=split)
    out = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        out.append(Example(row["question"], extract_gsm8k_answer(row["answer"]), _rationale(row["answer"])))
    return out


def _looks_like_hub_id(source: str) -> bool:
    """``owner/name`` with no further path parts, not starting like a local path."""
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~")) and not Path(parts[0]).exists()


def load_examples(source: str, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Example]:
    """Load a task by source.

    ``source`` is a JSONL path, a directory holding ``{split}.jsonl``, ``openai/gsm8k`` (the hub), or a
    registered synthetic task ``name`` / ``name:key=value,...`` (see ``rlvr.tasks``).
    """
    from rlvr import tasks

    if tasks.is_task_spec(source):
        return tasks.load_task(source, split=split, limit=limit, seed=seed)
    p = Path(source)
    if p.is_dir():
        p = p / f"{split}.jsonl"
        if not p.is_file():
            present = sorted(f.stem for f in Path(source).glob("*.jsonl"))
            raise DataError(f"{source} has no {split}.jsonl (splits there: {', '.join(present) or 'none'}); "
                            "choose one of those splits or another data directory")
        return load_gsm8k_jsonl(p, limit)
    if p.suffix == ".jsonl" or p.exists():
        return load_gsm8k_jsonl(p, limit)
    if _looks_like_hub_id(source):
        return load_gsm8k_hub(split, limit, name=source)
    raise DataError(
        f"cannot load data from {source!r}: give a JSONL file, a directory with {split}.jsonl, "
        f"the hub id 'openai/gsm8k', or a task name from rlvr.tasks ({', '.join(tasks.TASKS)})"
    )


def sample_batch(examples: list[Example], n: int, rng: random.Random) -> list[Example]:
    """``n`` distinct examples drawn with ``rng`` (reproducible for a seeded ``random.Random``)."""
    if n > len(examples):
        raise ValueError(f"asked for {n} prompts but the data has only {len(examples)}; lower n_prompts_per_rollout_batch")
    return rng.sample(examples, n)
