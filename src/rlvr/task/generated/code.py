"""``code``: small programming problems with tests, written for this project, for the ``code`` reward.

``code_problems.jsonl`` (next to this module) holds one problem a line: ``id``, ``split`` (``train``
or ``test``), ``question`` (the statement), ``solution`` (a reference program) and its tests,
``tests`` (stdin and expected stdout) or ``asserts`` (statements on the program's functions). An
example's question is the statement followed by how to answer; its ground truth is the tests as
JSON (what ``rlvr.task.code_reward`` reads); its solution is the reference program in a fenced block.
Split ``validation`` is the ``test`` problems. Options: ``size`` (at most that many problems).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlvr.task.example import DataError, Example

PROBLEMS = Path(__file__).with_name("code_problems.jsonl")
SPLITS = {"train": "train", "test": "test", "validation": "test"}
INSTRUCTION = "Write the program in Python 3, in one fenced block: ```python ... ```."


def load_code(
    split: str = "train", limit: int | None = None, seed: int = 0, size: int | str | None = None
) -> list[Example]:
    """The problems of ``split``, shuffled with ``seed``; ``limit`` (or ``size``) of them."""
    if split not in SPLITS:
        raise DataError(f"code: unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    rows = [json.loads(line) for line in PROBLEMS.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [row for row in rows if row["split"] == SPLITS[split]]
    random.Random(seed).shuffle(rows)
    n = limit if limit is not None else int(size) if size is not None else len(rows)
    return [
        Example(
            question=f"{row['question']}\n{INSTRUCTION}",
            ground_truth=json.dumps({key: row[key] for key in ("tests", "asserts") if key in row}),
            solution=f"```python\n{row['solution']}```",
            meta={"problem_id": row["id"]},
        )
        for row in rows[:n]
    ]
