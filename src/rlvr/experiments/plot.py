"""``rlvr plot RUN_DIRS_OR_SWEEP_DIR --out DIR``: every metric over steps, with the spread across seeds.

Runs are grouped by setting (the ``<setting>/seed_<k>`` layout of a sweep, else the config's name).
Each figure shows, per setting, the mean across seeds as a line, the spread as a band (min/max by
default, or the 95 % t-interval of the mean with ``--band ci95``) and every run as a faint line, so
a reader sees at once whether two settings differ by more than seeds do. Besides one PNG per metric:

- ``overview.png``: validation reward, train reward, entropy and response length side by side;
- ``final_val_reward_vs_lr.png`` when settings differ in learning rate: each run's final validation
  reward against its lr (log scale), with the mean and band per group of otherwise-equal settings;
- clip fractions (``train_clip_fraction.png``) appear for the settings that log them (off-policy);
- ``estimators/``: what each estimator did (``rlvr.experiments.estimators``): gradient weight per
  group against its pass rate with the closed form, gradient variance with and without a baseline,
  and importance ratios, clip fractions, KL and entropy per optimizer step within a rollout batch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from rlvr.experiments.estimators import estimator_figures

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from rlvr.config import flatten
from rlvr.experiments.runs import (
    BANDS,
    VAL_REWARD,
    Run,
    aggregate,
    config_value,
    final_values,
    group_runs,
    load_runs,
    varying_config_keys,
)

BAND_LABEL = {"minmax": "min/max across seeds", "ci95": "95% t-interval of the mean"}
OVERVIEW = ("val/reward", "train/reward", "train/entropy", "train/response_length")
LR_KEYS = ("lr", "learning_rate")
LINESTYLES = ("-", "--", "-.", ":")
_NOT_SETTING_KEYS = ("seed", "out", "out_dir", "output_dir", "run_dir", "name", "resume", "plugins")


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def metric_filename(metric: str) -> str:
    """``train/clip_fraction`` -> ``train_clip_fraction.png``."""
    return re.sub(r"[^A-Za-z0-9_.@=+-]+", "_", metric).strip("_") + ".png"


def _colors(n: int) -> list:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def all_metrics(runs: Sequence[Run]) -> list[str]:
    """Every numeric metric any run logged, in first-logged order (timings last)."""
    names: dict[str, None] = {}
    for run in runs:
        for name in run.metric_names():
            names.setdefault(name)
    return sorted(names, key=lambda m: (m.startswith("time/"), list(names).index(m)))


def draw_metric(
    ax: Axes,
    groups: dict[str, list[Run]],
    metric: str,
    band: str = "minmax",
    smoothing: int = 1,
    colors: dict[str, tuple] | None = None,
) -> bool:
    """Draw ``metric`` for every group that logged it onto ``ax``; False if none did."""
    colors = colors or dict(zip(groups, _colors(len(groups))))
    drawn = False
    for i, (setting, runs) in enumerate(groups.items()):
        agg = aggregate(runs, metric, band=band, smoothing=smoothing)
        if not len(agg.steps):
            continue
        drawn = True
        color = colors[setting]
        sparse = len(agg.steps) <= 30
        for row in agg.values:
            ok = ~np.isnan(row)
            ax.plot(agg.steps[ok], row[ok], color=color, alpha=0.25, linewidth=0.8)
        n_runs = int((~np.isnan(agg.values)).any(axis=1).sum())
        ax.fill_between(agg.steps, agg.lo, agg.hi, color=color, alpha=0.18, linewidth=0)
        # Alternating dash patterns keep settings whose means coincide visible on top of each other.
        ax.plot(
            agg.steps,
            agg.mean,
            color=color,
            linewidth=2.0,
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            marker="o" if sparse else None,
            markersize=3,
            label=f"{setting} (n={n_runs})",
        )
    return drawn


def _legend(ax: Axes, band: str, n_groups: int) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(color="grey", alpha=0.3), Line2D([], [], color="grey", alpha=0.4, linewidth=0.8)]
    labels += [f"band: {BAND_LABEL[band]}", "individual seeds"]
    ax.legend(handles, labels, fontsize=8, loc="best", ncol=2 if n_groups > 6 else 1, framealpha=0.8)


def plot_metric(
    groups: dict[str, list[Run]],
    metric: str,
    path: str | Path,
    band: str = "minmax",
    smoothing: int = 1,
    colors: dict | None = None,
) -> Path | None:
    """One PNG of ``metric`` over steps for every group (mean line, spread band, faint runs).
    Returns the path, or None when no run logged the metric."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    try:
        if not draw_metric(ax, groups, metric, band, smoothing, colors):
            return None
        smooth_note = f", smoothed over {smoothing} steps" if smoothing > 1 else ""
        ax.set_title(f"{metric}: mean across seeds, band = {BAND_LABEL[band]}{smooth_note}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        _legend(ax, band, len(groups))
        return _save(fig, path)
    finally:
        plt.close(fig)


def _save(fig: Figure, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_overview(
    groups: dict[str, list[Run]],
    path: str | Path,
    metrics: Sequence[str] = OVERVIEW,
    band: str = "minmax",
    smoothing: int = 1,
    colors: dict | None = None,
) -> Path | None:
    """The headline metrics side by side in one PNG (those that were logged); None if none was."""
    runs = [r for g in groups.values() for r in g]
    present = [m for m in metrics if any(len(r.series(m)[0]) for r in runs)]
    if not present:
        return None
    plt = _pyplot()
    cols = 2 if len(present) > 1 else 1
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.8 * rows), dpi=110, squeeze=False)
    try:
        for ax, metric in zip(axes.flat, present):
            draw_metric(ax, groups, metric, band, smoothing, colors)
            ax.set_title(metric, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(present) :]:
            ax.axis("off")
        _legend(axes.flat[0], band, len(groups))
        fig.suptitle(f"mean across seeds, band = {BAND_LABEL[band]}, seeds faint", fontsize=11)
        return _save(fig, path)
    finally:
        plt.close(fig)


def run_lr(run: Run) -> float | None:
    value = config_value(run.config, LR_KEYS)
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _signature(run: Run, keys: Sequence[str]) -> str:
    flat = flatten(run.config)
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={flat.get(k)}" for k in keys)


def _fewest_keys(groups: Sequence[Sequence[Run]], keys: Sequence[str]) -> list[str]:
    """The one key of ``keys`` that alone tells the groups' lines apart (a preset, say, rather than
    the preset and every field it sets), else all of ``keys``."""
    full = {_signature(g[0], keys) for g in groups}
    for key in keys:
        if len({_signature(g[0], [key]) for g in groups}) == len(full):
            return [key]
    return list(keys)


def _mean_best(group: Sequence[Run], metric: str) -> float:
    """Mean over runs of each run's best logged ``metric`` (NaN when none logged it)."""
    bests = [
        max(vals)
        for r in group
        if (vals := [row[metric] for row in r.metrics if isinstance(row.get(metric), (int, float))])
    ]
    return float(np.mean(bests)) if bests else float("nan")


def plot_final_vs_lr(
    runs: Sequence[Run], path: str | Path, metric: str = VAL_REWARD, band: str = "minmax"
) -> Path | None:
    """Final ``metric`` of every run against its learning rate, when settings differ in lr.

    Settings that differ in more than lr are drawn as separate lines, labelled by those other keys.
    Returns None when fewer than two learning rates are present or nothing logged ``metric``.
    """
    finals = final_values(runs, metric)
    by_setting = group_runs(runs)
    lrs = {s: run_lr(g[0]) for s, g in by_setting.items()}
    if len({lr for lr in lrs.values() if lr is not None}) < 2:
        return None
    other = [k for k in varying_config_keys(runs, ignore=_NOT_SETTING_KEYS) if k.rsplit(".", 1)[-1] not in LR_KEYS]
    other = _fewest_keys(list(by_setting.values()), other)
    lines: dict[str, list[tuple[float, str]]] = {}
    for setting, group in by_setting.items():
        lr = lrs[setting]
        if lr is None or not finals[setting].n:
            continue
        lines.setdefault(_signature(group[0], other), []).append((lr, setting))
    if not lines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for j, (color, (sig, points)) in enumerate(zip(_colors(len(lines)), sorted(lines.items()))):
            points.sort()
            dodge = 1.0 + 0.03 * (j - (len(lines) - 1) / 2)  # lines at the same lr side by side, not on top
            xs, means, los, his = [], [], [], []
            for lr, setting in points:
                fs = finals[setting]
                vals = np.asarray(list(fs.values.values()))
                ax.scatter([lr * dodge] * len(vals), vals, color=color, alpha=0.35, s=18)
                xs.append(lr * dodge)
                means.append(fs.mean)
                if band == "minmax":
                    los.append(fs.min)
                    his.append(fs.max)
                else:
                    half = fs.ci95 if fs.n > 1 else 0.0
                    los.append(fs.mean - half)
                    his.append(fs.mean + half)
            yerr = [np.subtract(means, los), np.subtract(his, means)]
            ax.errorbar(
                xs, means, yerr=yerr, color=color, marker="o", linewidth=2, capsize=4, label=sig or "mean across seeds"
            )
            bests = [_mean_best(by_setting[setting], metric) for _, setting in points]
            ax.plot(xs, bests, color=color, marker="^", linestyle="--", linewidth=1.2, alpha=0.8)
        if all(x > 0 for pts in lines.values() for x, _ in pts):
            ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(f"{metric}: final (solid), best (dashed)")
        ax.set_title(
            f"final and best {metric} vs learning rate (dots: seeds' finals; bars: {BAND_LABEL[band]})", fontsize=10
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_runs(
    runs: Sequence[Run],
    out_dir: str | Path,
    metrics: Sequence[str] | None = None,
    band: str = "minmax",
    smoothing: int = 1,
    estimators: bool = True,
) -> dict[str, Path]:
    """Write every figure for ``runs`` into ``out_dir``; returns ``{name: path}`` where name is a metric,
    ``overview`` or ``final_vs_lr``, or ``estimators/...`` for the figures of
    ``rlvr.experiments.estimators`` (difficulty weighting, gradient variance, off-policy drift per
    update; in ``out_dir/estimators``) when the runs logged what they need. ``metrics`` limits the
    per-metric figures (default: all logged)."""
    if band not in BANDS:
        raise ValueError(f"band must be one of {BANDS}, got {band!r}")
    out_dir = Path(out_dir)
    groups = group_runs(runs)
    colors = dict(zip(groups, _colors(len(groups))))
    # The variance/... metrics are drawn together in the estimator figures, not one figure each.
    wanted = list(metrics) if metrics else [m for m in all_metrics(runs) if not m.startswith("variance/")]
    written: dict[str, Path] = {}
    overview = plot_overview(groups, out_dir / "overview.png", band=band, smoothing=smoothing, colors=colors)
    if overview:
        written["overview"] = overview
    for metric in wanted:
        p = plot_metric(groups, metric, out_dir / metric_filename(metric), band, smoothing, colors)
        if p:
            written[metric] = p
    lr_plot = plot_final_vs_lr(runs, out_dir / "final_val_reward_vs_lr.png", band=band)
    if lr_plot:
        written["final_vs_lr"] = lr_plot
    if estimators:
        written.update(estimator_figures(runs, out_dir / "estimators"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlvr plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories and/or sweep directories")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    parser.add_argument("--metrics", nargs="+", help="only these metrics (default: every logged metric)")
    parser.add_argument("--band", choices=BANDS, default="minmax", help="spread across seeds (default minmax)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving average over this many steps per run")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.paths)
    except FileNotFoundError as e:
        print(f"rlvr plot: {e}", file=sys.stderr)
        return 2
    written = plot_runs(runs, args.out, metrics=args.metrics, band=args.band, smoothing=args.smooth)
    groups = group_runs(runs)
    print(f"{len(runs)} runs in {len(groups)} settings: " + ", ".join(f"{s} ({len(g)})" for s, g in groups.items()))
    if args.metrics:
        missing = [m for m in args.metrics if m not in written]
        if missing:
            print(f"not logged by any run: {missing}", file=sys.stderr)
    print(f"wrote {len(written)} figures to {args.out}")
    (Path(args.out) / "figures.json").write_text(json.dumps({k: v.name for k, v in written.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
