"""Run logging: ``metrics.jsonl`` always, with optional Weights & Biases and TensorBoard mirrors.

``metrics.jsonl`` holds one JSON object per line (one per step, plus the initial evaluation as step
0). Each line is flushed and fsynced as it is written, so a crash loses at most the line being
written; ``truncate_metrics`` drops lines past a checkpoint's step when a run resumes, so a resumed
run has no duplicate steps. A line that does not parse (cut by a crash, or damaged) is skipped with a
warning and every valid line around it is kept.

Rollout samples (the rows of ``DIR/rollouts/step_N.jsonl``) given under ``ROLLOUT_SAMPLES`` go to
the trackers as a table (a ``wandb.Table``; a Markdown table in TensorBoard's text tab), not to
``metrics.jsonl``, which the rollout files already complement.

W&B runs are named after the run directory: ``<setting>/seed_<k>`` and grouped by ``<setting>``
for a sweep's ``DIR/<setting>/seed_<k>/`` (and any directory named ``seed_<k>``), else the
directory's name.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

from rlvr.errors import UserError
from rlvr.training.rundir import atomic_write_jsonl, atomic_write_text

ROLLOUT_SAMPLES = "rollout_samples"
"""The metrics key whose value (a list of rollout records) goes to the trackers as a table."""
SAMPLE_COLUMNS = ("prompt", "response", "ground_truth", "reward", "advantage", "finish_reason")
"""The columns of the samples table, from each rollout record."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def read_metrics(path: str | Path, one_row_per_step: bool = False) -> list[dict]:
    """Rows of a ``metrics.jsonl``, in file order; a line cut by a crash at the end is dropped.

    With ``one_row_per_step`` the rows are sorted by step and a step logged twice (a resumed run
    restarts from its last checkpoint) keeps its later row; rows without a step come last."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif lineno < len(lines):  # the last line may simply have been cut by a crash
            warnings.warn(
                f"{path}:{lineno}: skipped a line that is not a JSON object (damaged); the other lines are kept",
                stacklevel=2,
            )
    if one_row_per_step:
        by_step = {int(r["step"]): r for r in rows if "step" in r}
        rows = [by_step[s] for s in sorted(by_step)] + [r for r in rows if "step" not in r]
    return rows


def truncate_metrics(path: str | Path, max_step: int) -> None:
    """Keep only the lines with ``step <= max_step`` (and drop a partial trailing line)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [
        r for r in read_metrics(path) if isinstance(r.get("step", 0), (int, float)) and r.get("step", 0) <= max_step
    ]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def wandb_name_and_group(run_dir: str | Path) -> tuple[str, str | None]:
    """``("<setting>/seed_<k>", "<setting>")`` for ``.../<setting>/seed_<k>``, else ``(name, None)``."""
    run_dir = Path(run_dir).resolve()
    if re.fullmatch(r"seed_\d+", run_dir.name) and run_dir.parent.name:
        return f"{run_dir.parent.name}/{run_dir.name}", run_dir.parent.name
    return run_dir.name, None


class MetricsLogger:
    """Append metrics to ``DIR/metrics.jsonl`` and mirror them to wandb / TensorBoard when asked."""

    def __init__(
        self,
        run_dir: str | Path,
        config_dict: dict | None = None,
        wandb: bool = False,
        wandb_project: str = "rlvr",
        tensorboard: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._wandb = None
        self._wandb_mod: Any = None
        self._tb = None
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                raise UserError(
                    "wandb logging is on but wandb is not installed: pip install 'rlvr[wandb]', or turn it off"
                ) from None
            id_file = self.run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else ""
            if not run_id:
                # Our own id: wandb.util.generate_id is gone from current wandb; W&B accepts any short [a-z0-9] id.
                run_id = uuid.uuid4().hex[:8]
                atomic_write_text(id_file, run_id)
            self._wandb_mod = wandb_mod
            name, group = wandb_name_and_group(self.run_dir)
            self._wandb = wandb_mod.init(
                project=wandb_project,
                id=run_id,
                resume="allow",
                dir=str(self.run_dir),
                name=name,
                group=group,
                config=config_dict,
            )
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError(
                    "tensorboard logging is on but tensorboard is not installed: pip install 'rlvr[tensorboard]', "
                    "or turn it off"
                ) from None
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, metrics: dict) -> None:
        samples = metrics.get(ROLLOUT_SAMPLES)
        metrics = {k: v for k, v in metrics.items() if k != ROLLOUT_SAMPLES}
        row = {k: _clean(v) for k, v in metrics.items()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        step = int(metrics.get("step", 0))
        numeric = {
            k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        rows = [[record.get(c) for c in SAMPLE_COLUMNS] for record in samples or []]
        if self._wandb is not None:
            table = {"samples": self._wandb_mod.Table(columns=list(SAMPLE_COLUMNS), data=rows)} if rows else {}
            self._wandb.log({**numeric, **table}, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            if rows:
                self._tb.add_text("samples", markdown_table(SAMPLE_COLUMNS, rows), step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            # finish() can return before W&B's service has written the run file; teardown waits for it.
            self._wandb_mod.teardown()
        if self._tb is not None:
            self._tb.close()


def markdown_table(columns: tuple[str, ...] | list[str], rows: list[list]) -> str:
    """A Markdown table; ``|`` and line breaks in cells are escaped so that each row stays one line."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` as JSON lines, atomically (a kill mid-write leaves no half file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(path, rows)
