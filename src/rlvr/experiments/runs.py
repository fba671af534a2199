"""Reading run directories and aggregating their metrics across seeds.

A run directory is what ``rlvr train --out DIR`` writes: ``config.json`` (the resolved config),
``metrics.jsonl`` (one JSON object per step, with a ``step`` key), ``rollouts/step_N.jsonl``
(sample rollouts) and ``summary.json`` (``{"status": "finished", ...}`` once the run completed).
A sweep directory holds runs as ``<setting>/seed_<k>/``.

``load_runs`` finds every run under the given paths and names its setting and seed from that layout
(falling back to the config); ``aggregate`` aligns one metric of several runs on their steps and
returns the mean with a spread across seeds: the min/max envelope or a 95 % Student-t interval of
the mean. Every claim about an RL variant needs that spread beside it: seeds of the same setting
routinely differ more than settings do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from rlvr.config import flatten
from rlvr.training.metrics_log import read_metrics

SEED_DIR = re.compile(r"^seed_(-?\d+)$")
BANDS = ("minmax", "ci95")
VAL_REWARD = "val/reward"

# Two-sided 95 % critical values of Student's t for 1..30 degrees of freedom (no scipy dependency).
_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t95(dof: int) -> float:
    """Two-sided 95 % critical value of Student's t with ``dof`` degrees of freedom (normal beyond 30)."""
    if dof < 1:
        return float("nan")
    if dof <= len(_T95):
        return _T95[dof - 1]
    return 1.960 + 2.4 / dof  # within 0.002 of the exact value for dof > 30


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_rollouts(path: str | Path) -> list[dict]:
    """Rows of one ``rollouts/step_N.jsonl`` dump (malformed lines dropped)."""
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


@dataclass
class Run:
    """One training run read from disk."""

    path: Path
    setting: str
    """The group the run belongs to: its parent directory for ``<setting>/seed_<k>`` layouts."""
    seed: int | None
    config: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    summary: dict | None = None

    @property
    def finished(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "finished"

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.metrics if "step" in r]
        return max(steps) if steps else None

    def metric_names(self) -> list[str]:
        """Every numeric metric logged at least once (``step`` excluded), in first-logged order."""
        names: dict[str, None] = {}
        for row in self.metrics:
            for key, value in row.items():
                if key != "step" and _is_number(value):
                    names.setdefault(key)
        return list(names)

    def series(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of the rows that logged ``metric`` as a finite number."""
        steps, values = [], []
        for row in self.metrics:
            value = row.get(metric)
            if "step" in row and _is_number(value) and math.isfinite(float(value)):
                steps.append(int(row["step"]))
                values.append(float(value))
        return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)

    def final(self, metric: str = VAL_REWARD) -> tuple[int, float] | None:
        """``(step, value)`` of the last logged value of ``metric``, or None if it was never logged."""
        steps, values = self.series(metric)
        if not len(steps):
            return None
        return int(steps[-1]), float(values[-1])

    def rollout_dumps(self, kind: str = "train") -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``rollouts/step_N.jsonl`` (``kind="train"``: training rollouts) or
        ``rollouts/val_step_N.jsonl`` (``kind="val"``: validation samples), by step."""
        prefix = {"train": "step_", "val": "val_step_"}[kind]
        found = []
        for p in (self.path / "rollouts").glob(f"{prefix}*.jsonl"):
            m = re.fullmatch(re.escape(prefix) + r"(\d+)\.jsonl", p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    @property
    def label(self) -> str:
        return f"{self.setting}/seed_{self.seed}" if self.seed is not None else self.setting


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def config_value(config: dict, names: Sequence[str]) -> Any:
    """The value of the first of ``names`` found in ``config``, matched on the full dotted key or its
    last component (so ``lr`` finds ``optim.lr``); None if absent."""
    flat = flatten(config)
    for name in names:
        if name in flat:
            return flat[name]
        for key, value in flat.items():
            if key.rsplit(".", 1)[-1] == name:
                return value
    return None


def load_run(path: str | Path, setting: str | None = None) -> Run:
    """Read the run in directory ``path``; ``setting`` and seed come from a ``<setting>/seed_<k>`` layout,
    else from the config (``seed``, ``name``) and the directory name."""
    path = Path(path)
    config = _read_json(path / "config.json") or {}
    m = SEED_DIR.match(path.name)
    seed: int | None
    if m:
        seed = int(m.group(1))
        setting = setting or path.parent.name
    else:
        s = config_value(config, ["seed"])
        seed = int(s) if _is_number(s) else None
        setting = setting or str(config.get("name") or path.name)
    return Run(
        path=path,
        setting=setting,
        seed=seed,
        config=config,
        metrics=read_metrics(path / "metrics.jsonl", one_row_per_step=True),
        summary=_read_json(path / "summary.json"),
    )


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "config.json").is_file()


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every run directory at or below ``root`` (a run's own subdirectories are not searched)."""
    root = Path(root)
    if is_run_dir(root):
        return [root]
    found = []
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.is_dir() and not child.name.startswith((".", "_")):
                found += find_run_dirs(child)
    return found


def load_runs(paths: str | Path | Iterable[str | Path]) -> list[Run]:
    """All runs in or below ``paths`` (run directories or sweep directories), sorted by setting and seed.

    A path that holds no run raises ``FileNotFoundError``: a typo should not plot an empty figure.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    runs = []
    for p in paths:
        dirs = find_run_dirs(p)
        if not dirs:
            raise FileNotFoundError(f"{p}: no run found (a run directory holds metrics.jsonl or config.json)")
        runs += [load_run(d) for d in dirs]
    return sorted(runs, key=lambda r: (r.setting, r.seed if r.seed is not None else -1, str(r.path)))


def group_runs(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """Runs by setting, in first-seen order."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.setting, []).append(run)
    return groups


@dataclass
class Aggregate:
    """One metric of a group of runs, aligned on steps. Arrays have one entry per step."""

    metric: str
    band: str
    steps: np.ndarray
    mean: np.ndarray
    lo: np.ndarray
    """Lower edge of the band: the min over runs, or mean - t * sd / sqrt(n)."""
    hi: np.ndarray
    n: np.ndarray
    """How many runs logged the metric at each step."""
    values: np.ndarray
    """(n_runs, n_steps), NaN where a run did not log the metric at that step."""


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` points (the first points average what exists so far)."""
    if window <= 1 or len(values) == 0:
        return values
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    start = np.maximum(idx - window, 0)
    return (c[idx] - c[start]) / (idx - start)


def aggregate(runs: Sequence[Run], metric: str, band: str = "minmax", smoothing: int = 1) -> Aggregate:
    """Mean of ``metric`` across ``runs`` at every step any of them logged it, with a spread band.

    ``band="minmax"``: the band spans the smallest and largest run. ``band="ci95"``: the 95 %
    Student-t interval of the mean, ``mean ± t(n-1) · sd / sqrt(n)`` with the sample sd (n - 1); with
    one run the interval is undefined and the band collapses onto the mean. Steps that only some runs
    reached (an interrupted or shorter run) average the runs that have them; ``n`` says how many.
    ``smoothing`` > 1 applies a trailing moving average to each run before aggregating.
    """
    if band not in BANDS:
        raise ValueError(f"band must be one of {BANDS}, got {band!r}")
    series = []
    for run in runs:
        steps, values = run.series(metric)
        series.append((steps, smooth(values, smoothing)))
    all_steps = np.unique(np.concatenate([s for s, _ in series])) if series else np.zeros(0, dtype=np.int64)
    matrix = np.full((len(series), len(all_steps)), np.nan)
    for i, (steps, values) in enumerate(series):
        matrix[i, np.searchsorted(all_steps, steps)] = values
    present = ~np.isnan(matrix)
    n = present.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        total = np.where(present, matrix, 0.0).sum(axis=0)
        mean = total / np.maximum(n, 1)
        mean[n == 0] = np.nan
        if band == "minmax":
            lo = np.where(n > 0, np.nanmin(np.where(present, matrix, np.inf), axis=0), np.nan)
            hi = np.where(n > 0, np.nanmax(np.where(present, matrix, -np.inf), axis=0), np.nan)
        else:
            sq = np.where(present, (matrix - mean) ** 2, 0.0).sum(axis=0)
            sd = np.sqrt(sq / np.maximum(n - 1, 1))
            half = np.array([t95(int(k) - 1) if k > 1 else 0.0 for k in n]) * sd / np.sqrt(np.maximum(n, 1))
            lo, hi = mean - half, mean + half
    return Aggregate(metric=metric, band=band, steps=all_steps, mean=mean, lo=lo, hi=hi, n=n, values=matrix)


@dataclass
class FinalSummary:
    """The final value of one metric for each run of a setting."""

    setting: str
    metric: str
    values: dict[str, float]
    """Run label (``seed_k`` or the directory name) -> last logged value."""
    steps: dict[str, int]
    """Run label -> the step of that value."""

    @property
    def n(self) -> int:
        return len(self.values)

    def _arr(self) -> np.ndarray:
        return np.asarray(list(self.values.values()), dtype=np.float64)

    @property
    def mean(self) -> float:
        return float(self._arr().mean()) if self.n else float("nan")

    @property
    def std(self) -> float:
        return float(self._arr().std(ddof=1)) if self.n > 1 else float("nan")

    @property
    def ci95(self) -> float:
        """Half-width of the 95 % t-interval of the mean (NaN for one run)."""
        return t95(self.n - 1) * self.std / math.sqrt(self.n) if self.n > 1 else float("nan")

    @property
    def min(self) -> float:
        return float(self._arr().min()) if self.n else float("nan")

    @property
    def max(self) -> float:
        return float(self._arr().max()) if self.n else float("nan")

    @property
    def best(self) -> tuple[str, float] | None:
        return max(self.values.items(), key=lambda kv: kv[1]) if self.n else None

    @property
    def worst(self) -> tuple[str, float] | None:
        return min(self.values.items(), key=lambda kv: kv[1]) if self.n else None


def final_values(runs: Sequence[Run], metric: str = VAL_REWARD) -> dict[str, FinalSummary]:
    """Per setting, the last logged value of ``metric`` of each run (runs that never logged it are left out)."""
    out = {}
    for setting, group in group_runs(runs).items():
        values, steps = {}, {}
        for run in group:
            last = run.final(metric)
            if last is None:
                continue
            label = f"seed_{run.seed}" if run.seed is not None else run.path.name
            steps[label], values[label] = last
        out[setting] = FinalSummary(setting=setting, metric=metric, values=values, steps=steps)
    return out


def varying_config_keys(runs: Sequence[Run], ignore: Sequence[str] = ("seed",)) -> list[str]:
    """Dotted config keys whose value differs between settings (``ignore`` matches full keys or last components)."""
    per_setting: dict[str, dict] = {}
    for run in runs:
        per_setting.setdefault(run.setting, flatten(run.config))
    keys = sorted(set().union(*per_setting.values())) if per_setting else []
    varying = []
    for key in keys:
        if key in ignore or key.rsplit(".", 1)[-1] in ignore:
            continue
        values = {json.dumps(cfg.get(key), sort_keys=True, default=str) for cfg in per_setting.values()}
        if len(values) > 1:
            varying.append(key)
    return varying
