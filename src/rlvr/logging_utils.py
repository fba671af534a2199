"""Run logging: ``metrics.jsonl`` always, with optional Weights & Biases and TensorBoard mirrors.

``metrics.jsonl`` holds one JSON object per line (one per step, plus the initial evaluation as step
0). Each line is flushed and fsynced as it is written, so a crash loses at most the line being
written; ``truncate_metrics`` drops lines past a checkpoint's step when a run resumes, so a resumed
run has no duplicate steps.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a crash ends the valid part of the file
    return rows


def truncate_metrics(path: str | Path, max_step: int) -> None:
    """Keep only the lines with ``step <= max_step`` (and drop a partial trailing line)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= max_step]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLogger:
    """Append metrics to ``DIR/metrics.jsonl`` and mirror them to wandb / TensorBoard when asked."""

    def __init__(self, run_dir: str | Path, config_dict: dict | None = None, wandb: bool = False,
                 wandb_project: str = "rlvr", tensorboard: bool = False):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._wandb = None
        self._tb = None
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                raise RuntimeError("log.wandb is on but wandb is not installed: pip install wandb, or drop --log.wandb") from None
            id_file = self.run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else wandb_mod.util.generate_id()
            id_file.write_text(run_id)
            self._wandb = wandb_mod.init(project=wandb_project, id=run_id, resume="allow", dir=str(self.run_dir),
                                         name=self.run_dir.name, config=config_dict)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeError("log.tensorboard is on but tensorboard is not installed: pip install tensorboard") from None
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, metrics: dict) -> None:
        row = {k: _clean(v) for k, v in metrics.items()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        step = int(metrics.get("step", 0))
        numeric = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
