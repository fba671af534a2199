"""What each estimator did in a run: difficulty weighting, gradient variance, off-policy drift.

Read from what ``rlvr train`` writes, for ``rlvr plot`` and ``rlvr report``:

* **difficulty weighting** from the rollout dumps (``rollouts/step_N.jsonl``: reward, advantage and
  trained token count of every rollout): each group's gradient weight ``W = sum_i |A_i| n_i a_i`` under
  the run's aggregation, binned by the group's pass rate p, against the closed form of
  ``rlvr.grpo.diagnostics`` for the run's (baseline, normalizer), group size and aggregation;
* **gradient variance** from the ``variance/...`` metrics (``log.gradient_variance_every``);
* **off-policy diagnostics** from the per-update records (``updates`` in each ``metrics.jsonl`` row of
  a run with several optimizer steps per rollout batch): importance-ratio quantiles, clip fractions,
  KL(sampling || current) and entropy against the optimizer step's index within its rollout batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from rlvr.config import flatten
from rlvr.experiments.runs import Run, aggregate, group_runs, read_rollouts
from rlvr.grpo.diagnostics import (
    ADVANTAGE_MASS,
    SEQ_EPS,
    TOKEN_EPS,
    group_gradient_weight,
    predicted_group_weight,
    token_coefficient,
)
from rlvr.grpo.variance import ESTIMATORS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# --- the run's estimator ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimator:
    """The advantage and aggregation settings of a run, from its resolved ``config.json``."""

    baseline: str
    normalizer: str
    loss_normalization: str
    group_size: int
    batch_size: int
    """Sequences per optimizer step (the B of sequence normalisation)."""
    normalization_constant: float | None
    eps: float

    @property
    def has_closed_form(self) -> bool:
        return (self.baseline, self.normalizer) in ADVANTAGE_MASS


def run_estimator(run: Run) -> Estimator | None:
    """The run's estimator, or None when its config lacks the resolved fields (not a ``rlvr train`` run)."""
    flat = flatten(run.config) if isinstance(run.config, dict) else {}
    try:
        G = int(flat["rollout.group_size"])
        n_prompts = int(flat["rollout.n_prompts_per_rollout_batch"])
        batch = flat.get("optim.train_batch_size") or G * n_prompts
        if flat["algorithm.loss_normalization"] == "constant" and not flat.get("algorithm.normalization_constant"):
            return None
        return Estimator(
            baseline=str(flat["algorithm.baseline"]),
            normalizer=str(flat["algorithm.advantage_normalizer"]),
            loss_normalization=str(flat["algorithm.loss_normalization"]),
            group_size=G,
            batch_size=int(batch),
            normalization_constant=flat.get("algorithm.normalization_constant"),
            eps=float(flat.get("algorithm.advantage_eps", 1e-6)),
        )
    except (KeyError, TypeError, ValueError):
        return None


# --- 1. difficulty weighting ------------------------------------------------------------------------


@dataclass
class GroupWeight:
    """One group of one dumped rollout batch."""

    step: int
    successes: int | None
    """Number of reward-1 samples (None when the rewards are not all 0 or 1)."""
    pass_rate: float
    """Mean reward of the group (k / G for binary rewards)."""
    weight: float
    """Measured gradient weight W = sum_i |A_i| n_i a_i."""
    correct_length: float
    incorrect_length: float
    """Mean trained response length of the group's correct and incorrect samples (0 when there are none)."""


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def group_weights(rows: Sequence[dict], est: Estimator) -> list[GroupWeight]:
    """The groups of one dump (rows in the trainer's order: consecutive groups of ``est.group_size``)."""
    G = est.group_size
    if len(rows) % G:
        raise ValueError(f"a dump of {len(rows)} rollouts is not whole groups of {G}")
    out = []
    for start in range(0, len(rows), G):
        grp = rows[start : start + G]
        rewards = [float(r["reward"]) for r in grp]
        lengths = [float(r.get("n_train_tokens", r.get("n_tokens", 0))) for r in grp]
        advantages = [float(r["advantage"]) for r in grp]
        binary = all(x in (0.0, 1.0) for x in rewards)
        correct = [n for n, x in zip(lengths, rewards) if x == 1.0]
        incorrect = [n for n, x in zip(lengths, rewards) if x != 1.0]
        out.append(
            GroupWeight(
                step=int(grp[0].get("step", 0)),
                successes=int(sum(rewards)) if binary else None,
                pass_rate=_mean(rewards),
                weight=group_gradient_weight(
                    advantages, lengths, est.loss_normalization, est.batch_size, est.normalization_constant
                ),
                correct_length=_mean(correct),
                incorrect_length=_mean(incorrect),
            )
        )
    return out


def load_group_weights(run: Run, est: Estimator | None = None) -> list[GroupWeight]:
    """Every group of every training-rollout dump of ``run`` ([] when it has none or no estimator)."""
    est = est or run_estimator(run)
    if est is None:
        return []
    out = []
    for _, path in run.rollout_dumps("train"):
        rows = read_rollouts(path)
        # A dump that is not whole groups with advantages (written by something else) is left out.
        if rows and len(rows) % est.group_size == 0 and all("advantage" in r and "reward" in r for r in rows):
            out += group_weights(rows, est)
    return out


@dataclass
class WeightingBins:
    """Groups binned by pass rate, with the closed form beside each bin."""

    setting: str
    est: Estimator
    p: np.ndarray
    """Bin centres: k / G for binary rewards, else the midpoints of ten equal bins."""
    n_groups: np.ndarray
    mean_weight: np.ndarray
    sem_weight: np.ndarray
    share: np.ndarray
    """Share of the total gradient weight of all groups that falls in each bin."""
    closed_form_exact: np.ndarray | None
    """Mean over the bin of the closed form with each group's own class lengths: equals ``mean_weight``."""
    closed_form: np.ndarray | None
    """The closed form with the setting's mean lengths of correct and incorrect responses (the curve)."""
    correct_length: float = 0.0
    incorrect_length: float = 0.0
    groups: list[GroupWeight] = field(default_factory=list)

    @property
    def binary(self) -> bool:
        return self.closed_form is not None


def _lengths(groups: Sequence[GroupWeight], est: Estimator) -> tuple[float, float]:
    # Pooled per sample: a group's class mean weighs by its number of samples in that class.
    G = est.group_size
    counted = [(g, g.successes) for g in groups if g.successes is not None]
    if len(counted) != len(groups):
        raise ValueError("class lengths need every group's number of successes (binary rewards)")
    num_c = sum(g.correct_length * k for g, k in counted)
    num_i = sum(g.incorrect_length * (G - k) for g, k in counted)
    den_c = sum(k for _, k in counted)
    den_i = sum(G - k for _, k in counted)
    return (num_c / den_c if den_c else 0.0), (num_i / den_i if den_i else 0.0)


def closed_form_weight(est: Estimator, successes: int, correct_length: float, incorrect_length: float) -> float:
    return predicted_group_weight(
        est.baseline,
        est.normalizer,
        est.group_size,
        successes,
        est.loss_normalization,
        est.batch_size,
        est.normalization_constant,
        est.eps,
        correct_length,
        incorrect_length,
    )


def bin_group_weights(setting: str, groups: Sequence[GroupWeight], est: Estimator) -> WeightingBins:
    """Groups binned by pass rate: per k = 0..G for binary rewards (with the closed form), else deciles."""
    groups = list(groups)
    total = sum(g.weight for g in groups) or 1.0
    binary = bool(groups) and all(g.successes is not None for g in groups) and est.has_closed_form
    if binary:
        G = est.group_size
        keys = list(range(G + 1))
        centres = np.array([k / G for k in keys])
        members = [[g for g in groups if g.successes == k] for k in keys]
    else:
        edges = np.linspace(0, 1, 11)
        centres = (edges[:-1] + edges[1:]) / 2
        idx = [min(int(g.pass_rate * 10), 9) for g in groups]
        members = [[g for g, i in zip(groups, idx) if i == b] for b in range(10)]
    n = np.array([len(m) for m in members])
    w = [np.array([g.weight for g in m]) for m in members]
    mean = np.array([x.mean() if len(x) else np.nan for x in w])
    sem = np.array([x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else 0.0 for x in w])
    share = np.array([x.sum() / total for x in w])
    bins = WeightingBins(
        setting=setting,
        est=est,
        p=centres,
        n_groups=n,
        mean_weight=mean,
        sem_weight=sem,
        share=share,
        closed_form_exact=None,
        closed_form=None,
        groups=groups,
    )
    if binary:
        lc, li = _lengths(groups, est)
        bins.correct_length, bins.incorrect_length = lc, li
        bins.closed_form = np.array([closed_form_weight(est, k, lc, li) for k in keys])
        bins.closed_form_exact = np.array(
            [
                _mean([closed_form_weight(est, k, g.correct_length, g.incorrect_length) for g in m]) if m else np.nan
                for k, m in zip(keys, members)
            ]
        )
    return bins


def weighting_by_setting(runs: Sequence[Run]) -> dict[str, WeightingBins]:
    """Per setting (all its seeds and dumps pooled), the binned weights; settings without dumps are left out.
    Runs of one setting with different estimators (not a sweep's layout) are binned with the first's."""
    out = {}
    for setting, group in group_runs(runs).items():
        est = next((e for e in map(run_estimator, group) if e is not None), None)
        if est is None:
            continue
        weights = [w for run in group for w in load_group_weights(run, est)]
        if weights:
            out[setting] = bin_group_weights(setting, weights, est)
    return out


_FORMULAS = {  # (baseline, normalizer): (the advantage mass's coefficient as a function of G, its shape in p)
    ("mean", "none"): (lambda G: 2 * G, "p(1-p)"),
    ("mean", "std"): (lambda G: 2 * math.sqrt(G * (G - 1)), "sqrt(p(1-p))"),
    ("mean", "mean"): (lambda G: 2 * G, "(1-p)"),
    ("none", "none"): (lambda G: G, "p"),
}


def formula_text(est: Estimator, correct_length: float = 0.0, incorrect_length: float = 0.0) -> str:
    """The closed form of ``est`` with the run's constants, as plain text (eps left out)."""
    G, B, C = est.group_size, est.batch_size, est.normalization_constant
    key = (est.baseline, est.normalizer)
    if key not in _FORMULAS:
        kind = "the registered closed form" if est.has_closed_form else "measured only, no closed form"
        return f"baseline={est.baseline}, normalizer={est.normalizer}: {kind}"
    coef, shape = _FORMULAS[key]
    c = coef(G)
    if est.loss_normalization == "sequence":
        return f"W = {c:.4g} {shape} / B = {c / B:.4g} {shape}  (G={G}, B={B})"
    if C is None:
        raise ValueError(
            f"loss_normalization={est.loss_normalization!r} has no closed form without a normalization constant"
        )
    if key == ("none", "none"):
        return f"W = {G} p n+ / C = {G * correct_length / C:.4g} p  (G={G}, n+={correct_length:.1f}, C={C:g})"
    length = (correct_length + incorrect_length) / 2
    return (
        f"W = {c:.4g} {shape} (n+ + n-)/2 / C = {c * length / C:.4g} {shape}  "
        f"(G={G}, n+={correct_length:.1f}, n-={incorrect_length:.1f}, C={C:g})"
    )


# --- 2. gradient variance ---------------------------------------------------------------------------

VARIANCE_LABELS = {
    "no_baseline": "no baseline (A = r)",
    "mean_baseline": "mean baseline (A = r - mean r)",
    "leave_one_out": "leave-one-out baseline",
    "run": "the run's estimator (its own scale)",
}


def has_variance(runs: Sequence[Run]) -> bool:
    return any(len(r.series("variance/no_baseline/trace")[0]) for r in runs)


def variance_measurements(run: Run) -> list[dict]:
    """One dict per logged variance measurement of ``run``: its step, the batch's mean reward ``p`` and
    the ``variance/...`` values without the prefix."""
    out = []
    for row in run.metrics:
        if isinstance(row.get("variance/no_baseline/trace"), (int, float)):
            m = {k[len("variance/") :]: v for k, v in row.items() if k.startswith("variance/")}
            m.update(step=row.get("step"), p=row.get("train/reward"))
            out.append(m)
    return out


def predicted_baseline_change(p: object, energy_correct: object, energy_incorrect: object) -> float | None:
    """``(1 - p) ((1 - p) + p E- / E+)``: the mean baseline's second moment over no baseline's when a
    group's correct and incorrect score sums are orthogonal (docs/theory.md, section 2). None unless all
    three are finite numbers (a logged row may lack them) and ``energy_correct`` is positive."""
    if not (
        isinstance(p, (int, float))
        and isinstance(energy_correct, (int, float))
        and isinstance(energy_incorrect, (int, float))
    ):
        return None
    if not all(math.isfinite(x) for x in (p, energy_correct, energy_incorrect)) or energy_correct <= 0:
        return None
    return (1 - p) * ((1 - p) + p * energy_incorrect / energy_correct)


def _g(x: object) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) and math.isfinite(x) else "–"


def variance_table(runs: Sequence[Run], per_measurement_up_to: int = 12) -> str:
    """Markdown: per setting, the per-group gradient variance of each estimator averaged over every
    measurement (steps and seeds), the ratios without / with the leave-one-out baseline, the bias check,
    and whether the sign of the mean baseline's effect follows ``predicted_baseline_change``. Settings
    with at most ``per_measurement_up_to`` measurements also get one row per measurement."""
    lines = [
        "| setting | measurements | no baseline | mean baseline | leave-one-out | run's estimator | "
        "no baseline / leave-one-out | projected: no baseline / leave-one-out | baseline bias ratio | "
        "score energy incorrect / correct | mean baseline up or down as predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    detail = [
        "| setting | step | mean reward p | no baseline | mean baseline | mean / no baseline | predicted "
        "(1-p)((1-p)+p E-/E+) | E- / E+ | projected: no baseline | projected: leave-one-out | bias ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, group in group_runs(runs).items():
        ms = [m for run in group for m in variance_measurements(run)]
        if not ms:
            continue
        col = lambda key, ms=ms: np.array(
            [m.get(key) if isinstance(m.get(key), (int, float)) else np.nan for m in ms], dtype=float
        )  # noqa: E731
        mean = lambda x: _g(float(np.nanmean(x))) if np.isfinite(x).any() else "–"  # noqa: E731
        nb, mb = col("no_baseline/trace"), col("mean_baseline/trace")
        e_c, e_i = col("score_energy_correct"), col("score_energy_incorrect")
        agree, judged = 0, 0
        for m, a, b in zip(ms, nb, mb):
            pred = predicted_baseline_change(m.get("p"), m.get("score_energy_correct"), m.get("score_energy_incorrect"))
            if pred is not None and a > 0 and pred != 1:
                judged += 1
                agree += (b > a) == (pred > 1)
        lines.append(
            f"| {setting} | {len(ms)} | {mean(nb)} | {mean(mb)} | {mean(col('leave_one_out/trace'))} | "
            f"{mean(col('run/trace'))} | {_ratio(nb, col('leave_one_out/trace'))} | "
            f"{_ratio(col('no_baseline/projected'), col('leave_one_out/projected'))} | "
            f"{mean(col('baseline_bias_ratio'))} | {_ratio(e_i, e_c)} | {f'{agree}/{judged}' if judged else '–'} |"
        )
        if len(ms) <= per_measurement_up_to:
            for m in ms:
                pred = predicted_baseline_change(
                    m.get("p"), m.get("score_energy_correct"), m.get("score_energy_incorrect")
                )
                a, b = m.get("no_baseline/trace"), m.get("mean_baseline/trace")
                e = (
                    m["score_energy_incorrect"] / m["score_energy_correct"]
                    if m.get("score_energy_correct") and m.get("score_energy_incorrect") is not None
                    else None
                )
                detail.append(
                    f"| {setting} | {m.get('step')} | {_g(m.get('p'))} | {_g(a)} | {_g(b)} | "
                    f"{_g(b / a) if a else '–'} | {_g(pred)} | {_g(e)} | {_g(m.get('no_baseline/projected'))} | "
                    f"{_g(m.get('leave_one_out/projected'))} | {_g(m.get('baseline_bias_ratio'))} |"
                )
    table = "\n".join(lines)
    return table + ("\n\n" + "\n".join(detail) if len(detail) > 2 else "")


def _ratio(a: np.ndarray, b: np.ndarray) -> str:
    """Geometric mean of the per-measurement ratios a / b, with their range."""
    if len(a) != len(b):
        return "–"
    ok = np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    if not ok.any():
        return "–"
    r = a[ok] / b[ok]
    return f"{math.exp(np.log(r).mean()):.3g} ({r.min():.3g} – {r.max():.3g})"


# --- 3. off-policy diagnostics per update -----------------------------------------------------------


def update_records(run: Run) -> list[tuple[int, dict]]:
    """``(rollout step, record)`` of every logged optimizer step of ``run``."""
    out = []
    for row in run.metrics:
        for rec in row.get("updates") or []:
            if isinstance(rec, dict) and "update" in rec:
                out.append((int(row.get("step", 0)), rec))
    return out


def has_updates(runs: Sequence[Run]) -> bool:
    return any(len({rec["update"] for _, rec in update_records(r)}) > 1 for r in runs)


@dataclass
class UpdateCurves:
    """Per training phase, the mean over rollout steps (and seeds) of each field at each update index,
    weighted by the tokens each update trained on."""

    setting: str
    updates: np.ndarray
    phases: list[tuple[int, int]]
    """(first, last) rollout step of each phase."""
    values: dict[str, np.ndarray]
    """field -> (n_phases, n_updates); NaN where nothing was logged."""
    overall: dict[str, np.ndarray]
    """field -> (n_updates,), the mean over the whole run."""


def update_curves(setting: str, runs: Sequence[Run], n_phases: int = 4) -> UpdateCurves | None:
    """The records of ``runs`` by update index, in up to ``n_phases`` phases of at least three rollout steps."""
    records = [(s, rec) for r in runs for s, rec in update_records(r)]
    if not records:
        return None
    steps = sorted({s for s, _ in records})
    n_phases = max(1, min(n_phases, len(steps) // 3))
    cuts = np.array_split(np.array(steps), n_phases)
    phases = [(int(c[0]), int(c[-1])) for c in cuts if len(c)]
    phase_of = {int(s): i for i, c in enumerate(cuts) for s in c}
    updates = np.array(sorted({int(rec["update"]) for _, rec in records}))
    index = {u: i for i, u in enumerate(updates)}
    fields = sorted(
        {k for _, rec in records for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        - {"update"}
    )
    sums = {f: np.zeros((len(phases), len(updates))) for f in fields}
    counts = {f: np.zeros((len(phases), len(updates))) for f in fields}
    for s, rec in records:
        i, j = phase_of[s], index[int(rec["update"])]
        # Weighted by the tokens the update trained on: an update that saw two short sequences says less.
        weight = max(float(rec.get("n_trained_tokens") or rec.get("n_tokens") or 1), 1.0)
        for f in fields:
            v = rec.get(f)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                sums[f][i, j] += weight * v
                counts[f][i, j] += weight
    with np.errstate(invalid="ignore"):
        values = {f: np.where(counts[f] > 0, sums[f] / np.maximum(counts[f], 1), np.nan) for f in fields}
        overall = {
            f: np.where(counts[f].sum(0) > 0, sums[f].sum(0) / np.maximum(counts[f].sum(0), 1), np.nan) for f in fields
        }
    return UpdateCurves(setting=setting, updates=updates, phases=phases, values=values, overall=overall)


def kl_growth_exponent(c: UpdateCurves, key: str = "kl_k3") -> float | None:
    """Slope a of log KL against log (j - 1) over the updates j >= 2 (KL ~ (j - 1)^a): 2 when successive
    steps move the policy the same way (KL is quadratic in the displacement), 1 when they add up like a
    random walk. None with fewer than two updates of positive KL."""
    v = c.overall.get(key)
    if v is None:
        return None
    ok = (c.updates >= 2) & np.isfinite(v) & (v > 0)
    if ok.sum() < 2:
        return None
    x, y = np.log(c.updates[ok] - 1.0), np.log(v[ok])
    return float(np.polyfit(x, y, 1)[0])


def offpolicy_table(curves: dict[str, UpdateCurves]) -> str:
    """Markdown: per setting, the first and the last quarter of the updates of a batch (the median over
    the quarter's update indices of the run's mean), and the growth exponent of the KL within a batch."""
    cols = [
        ("token_ratio_q99", "token ratio q99"),
        ("token_ratio_q01", "token ratio q01"),
        ("seq_ratio_q99", "seq ratio q99"),
        ("token_clip_frac", "token clip frac"),
        ("seq_clip_frac", "seq clip frac"),
        ("kl_k3", "KL k3"),
        ("entropy", "entropy"),
        ("grad_norm", "grad norm"),
    ]
    lines = [
        "| setting | " + " | ".join(name for _, name in cols) + " | KL growth exponent |",
        "|---|" + "---|" * (len(cols) + 1),
    ]
    for setting, c in curves.items():
        cells = []
        for key, _ in cols:
            v = c.overall.get(key)
            cells.append(
                "–"
                if v is None or np.isnan(v).all()
                else f"{_quarter(v, c, first=True)} → {_quarter(v, c, first=False)}"
            )
        a = kl_growth_exponent(c)
        cells.append("–" if a is None else f"{a:.2f}")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _quarter(v: np.ndarray, c: UpdateCurves, first: bool) -> str:
    """Median of ``v`` over the first (last) quarter of the update indices (at least one update): one
    update that drifted far does not stand for its quarter."""
    n = max(1, len(v) // 4)
    part = v[:n] if first else v[-n:]
    part = part[np.isfinite(part)]
    return f"{np.median(part):.3g}" if len(part) else "–"


# --- figures ----------------------------------------------------------------------------------------


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(text: str, width_chars: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, max(55, width_chars)))


def _save(fig: Figure, path: Path, title: str | None = None) -> Path:
    """Lay ``fig`` out under its ``title`` and write it to ``path``; returns ``path``."""
    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_weighting(bins: dict[str, WeightingBins], path: Path) -> Path | None:
    """Per setting: mean gradient weight per group against pass rate with the closed form (top), and the
    share of the total weight and of the groups in each bin (bottom)."""
    if not bins:
        return None
    plt = _pyplot()
    n = len(bins)
    fig, axes = plt.subplots(2, n, figsize=(5.0 * n, 7.2), dpi=110, squeeze=False)
    try:
        for col, (setting, b) in enumerate(bins.items()):
            ax = axes[0, col]
            jitter = np.random.default_rng(0).uniform(-0.012, 0.012, len(b.groups))
            ax.scatter(
                [g.pass_rate + j for g, j in zip(b.groups, jitter)],
                [g.weight for g in b.groups],
                s=6,
                color="grey",
                alpha=0.3,
                label="one group",
            )
            ok = b.n_groups > 0
            ax.errorbar(
                b.p[ok],
                b.mean_weight[ok],
                yerr=b.sem_weight[ok],
                fmt="o",
                color="tab:blue",
                capsize=3,
                label="measured mean ± s.e.",
            )
            if b.binary:
                pp = np.linspace(0, 1, 201)
                est = b.est
                curve = _smooth_curve(est, pp, b.correct_length, b.incorrect_length)
                ax.plot(pp, curve, color="tab:red", linewidth=1.5, label="closed form")
                ax.plot(b.p, b.closed_form, "x", color="tab:red")
                ax.set_title(f"{setting}\n{formula_text(est, b.correct_length, b.incorrect_length)}", fontsize=7.5)
            else:
                ax.set_title(f"{setting}\n(rewards not all 0/1: no closed form)", fontsize=8)
            ax.set_xlabel("group pass rate p")
            ax.set_ylabel("gradient weight W per group")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            ax2 = axes[1, col]
            width = 0.4 / max(len(b.p) - 1, 1)
            ax2.bar(b.p - width / 2, b.share, width=width, color="tab:blue", alpha=0.8, label="share of total weight")
            ax2.bar(
                b.p + width / 2,
                b.n_groups / max(b.n_groups.sum(), 1),
                width=width,
                color="grey",
                alpha=0.6,
                label="share of groups",
            )
            ax2.set_xlabel("group pass rate p")
            ax2.set_ylabel("share")
            ax2.set_title(f"{int(b.n_groups.sum())} groups from the rollout dumps", fontsize=8)
            ax2.grid(alpha=0.3)
            ax2.legend(fontsize=7)
        figure_title = (
            "Difficulty weighting: the gradient weight of a group is the sum over its tokens of |A| x "
            "the aggregation's coefficient"
        )
        return _save(fig, path, _wrap(figure_title, 12 * n))
    finally:
        plt.close(fig)


def _smooth_curve(est: Estimator, p: np.ndarray, lc: float, li: float) -> np.ndarray:
    """The closed form at a continuous p (the mass formulas hold for any p; only k/G occur)."""

    fn = ADVANTAGE_MASS[(est.baseline, est.normalizer)]
    out = []
    for x in p:
        on_c, on_i = fn(est.group_size, float(x), est.eps)
        if est.loss_normalization == "sequence":
            out.append((on_c + on_i) / est.batch_size)
        else:
            out.append(
                (on_c * lc + on_i * li) * token_coefficient("constant", 1, est.batch_size, est.normalization_constant)
            )
    return np.array(out)


def plot_weighting_shapes(bins: dict[str, WeightingBins], path: Path) -> Path | None:
    """Every setting on one axis, each divided by the largest value of its closed form over k = 0..G, so the
    shapes p(1-p), sqrt(p(1-p)), 1-p and p compare whatever the scale."""
    scales = {s: float(np.nanmax(b.closed_form)) for s, b in bins.items() if b.closed_form is not None}
    shown = {s: b for s, b in bins.items() if scales.get(s, 0.0) > 0}
    if not shown:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    try:
        colors = plt.get_cmap("tab10")
        pp = np.linspace(0, 1, 201)
        for i, (setting, b) in enumerate(shown.items()):
            scale = scales[setting]
            color = colors(i % 10)
            ok = b.n_groups > 0
            ax.errorbar(
                b.p[ok] + 0.006 * (i - len(shown) / 2),
                b.mean_weight[ok] / scale,
                yerr=b.sem_weight[ok] / scale,
                fmt="o",
                color=color,
                capsize=2,
                markersize=4,
                label=f"{setting}: measured",
            )
            ax.plot(
                pp,
                _smooth_curve(b.est, pp, b.correct_length, b.incorrect_length) / scale,
                color=color,
                linewidth=1.2,
                alpha=0.8,
                label=f"{setting}: {_FORMULAS.get((b.est.baseline, b.est.normalizer), (None, 'closed form'))[1]}",
            )
        ax.set_xlabel("group pass rate p")
        ax.set_ylabel("gradient weight / largest closed-form value")
        ax.set_title("Difficulty weighting of each setting, scaled to its own maximum", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_variance(runs: Sequence[Run], path: Path) -> Path | None:
    """Per setting: trace (solid) and projected (dashed) per-group gradient variance of each estimator
    over training steps, mean across seeds."""

    groups = {s: g for s, g in group_runs(runs).items() if has_variance(g)}
    if not groups:
        return None
    plt = _pyplot()
    n = len(groups)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.2), dpi=110, squeeze=False)
    colors = {"no_baseline": "tab:red", "mean_baseline": "tab:blue", "leave_one_out": "tab:green", "run": "tab:purple"}
    try:
        for ax, (setting, group) in zip(axes[0], groups.items()):
            for est in ESTIMATORS:
                for kind, style in (("trace", "-"), ("projected", "--")):
                    agg = aggregate(group, f"variance/{est}/{kind}")
                    if not len(agg.steps):
                        continue
                    label = f"{VARIANCE_LABELS[est]}" if kind == "trace" else None
                    ax.plot(agg.steps, agg.mean, style, color=colors[est], marker="o", markersize=3, label=label)
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("per-group gradient variance")
            ax.set_title(
                f"{setting}\nsolid: trace of the covariance across groups\ndashed: along the other groups' "
                "leave-one-out mean gradient",
                fontsize=8,
            )
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        figure_title = (
            "Gradient variance on the same rollouts, re-scored under each advantage estimator (mean across seeds)"
        )
        return _save(fig, path, _wrap(figure_title, 12 * n))
    finally:
        plt.close(fig)


_PHASE_CMAP = "viridis"


def _plot_finite(ax: Axes, x: np.ndarray, y: np.ndarray, *args: Any, **kwargs: Any) -> None:
    """``ax.plot`` of the finite points only, joined across the updates that logged nothing."""
    ok = np.isfinite(y)
    ax.plot(x[ok], y[ok], *args, **kwargs)


def plot_offpolicy(curves: UpdateCurves, path: Path) -> Path | None:
    """One setting: importance ratios, clip fractions, KL, entropy and gradient norm against the optimizer
    step's index within its rollout batch, one colour per training phase."""
    if len(curves.updates) < 2:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=100)
    cmap = plt.get_cmap(_PHASE_CMAP)
    x = curves.updates
    n_ph = len(curves.phases)
    try:
        for row_ax, prefix, eps, title in (
            (axes[0, 0], "token_ratio", TOKEN_EPS, "token ratio w - 1"),
            (axes[0, 1], "seq_ratio", SEQ_EPS, "sequence ratio s - 1 (GSPO's)"),
        ):
            for i, (a, b) in enumerate(curves.phases):
                color = cmap(i / max(n_ph - 1, 1))
                v = curves.values
                if f"{prefix}_q50" not in v:
                    continue
                lo, hi = v[f"{prefix}_q05"][i] - 1, v[f"{prefix}_q95"][i] - 1
                ok = np.isfinite(lo) & np.isfinite(hi)
                row_ax.fill_between(x[ok], lo[ok], hi[ok], color=color, alpha=0.15)
                _plot_finite(
                    row_ax, x, v[f"{prefix}_q50"][i] - 1, color=color, linewidth=1.8, label=f"steps {a}-{b}: median"
                )
                _plot_finite(row_ax, x, v[f"{prefix}_q01"][i] - 1, color=color, linewidth=0.8, linestyle="--")
                _plot_finite(row_ax, x, v[f"{prefix}_q99"][i] - 1, color=color, linewidth=0.8, linestyle="--")
                _plot_finite(row_ax, x, v[f"{prefix}_max"][i] - 1, color=color, linewidth=0.6, linestyle=":")
            row_ax.axhline(eps, color="red", linewidth=0.8)
            row_ax.axhline(-eps, color="red", linewidth=0.8)
            row_ax.set_yscale("symlog", linthresh=min(eps, 1e-3) / 3)
            row_ax.set_title(f"{title}\nmedian, band q05-q95, dashed q01/q99, dotted max; red: ±{eps:g}", fontsize=8)
        ax = axes[0, 2]
        for i in range(n_ph):
            color = cmap(i / max(n_ph - 1, 1))
            for key, style, name in (
                ("token_clip_frac", "-", f"token (PPO, eps {TOKEN_EPS:g})"),
                ("seq_clip_frac", "--", f"sequence (GSPO, eps {SEQ_EPS:g})"),
                ("clip_fraction", ":", "the method's own"),
            ):
                if key in curves.values:
                    _plot_finite(
                        ax, x, curves.values[key][i], style, color=color, label=name if i == n_ph - 1 else None
                    )
        ax.set_title("clip fractions (would-be for methods that do not clip)", fontsize=8)
        for ax, key, title, log in (
            (axes[1, 0], "kl_k3", "KL(sampling || current) per token, k3 estimate", True),
            (axes[1, 1], "entropy", "entropy of the current policy per token", False),
            (axes[1, 2], "grad_norm", "gradient norm before clipping", True),
        ):
            if key not in curves.values:
                ax.set_title(f"{title}: not logged", fontsize=8)
                continue
            for i, (a, b) in enumerate(curves.phases):
                y = curves.values[key][i]
                if log and key == "kl_k3":  # the first update runs on the sampling weights: its KL is rounding
                    y = np.where((y > 0) & (x > 1), y, np.nan)
                elif log:
                    y = np.where(y > 0, y, np.nan)
                _plot_finite(
                    ax, x, y, color=cmap(i / max(n_ph - 1, 1)), marker="o", markersize=2.5, label=f"steps {a}-{b}"
                )
            if log:
                ax.set_yscale("log")
            ax.set_title(title, fontsize=8)
        for ax in axes.flat:
            ax.set_xlabel("optimizer step within the rollout batch")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6.5)
        figure_title = (
            f"{curves.setting}: off-policy drift within a rollout batch (colour: training phase; token-weighted "
            f"mean over its rollout steps and seeds)"
        )
        return _save(fig, path, figure_title)
    finally:
        plt.close(fig)


def plot_offpolicy_comparison(curves: dict[str, UpdateCurves], path: Path) -> Path | None:
    """Every setting on one axis per quantity, averaged over the whole run."""
    shown = {s: c for s, c in curves.items() if len(c.updates) > 1}
    if not shown:
        return None
    plt = _pyplot()
    panels = (
        ("token_ratio_spread", "token ratio: q99 - q01", "log"),
        ("seq_ratio_spread", "sequence ratio: q99 - q01", "log"),
        ("kl_k3", "KL(sampling || current) per token, k3", "log"),
        ("entropy", "entropy per token", "linear"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), dpi=100)
    colors = plt.get_cmap("tab10")
    try:
        for ax, (key, title, scale) in zip(axes, panels):
            for i, (setting, c) in enumerate(shown.items()):
                if key.endswith("_spread"):
                    prefix = key[: -len("_spread")]
                    if f"{prefix}_q99" not in c.overall:
                        continue
                    y = c.overall[f"{prefix}_q99"] - c.overall[f"{prefix}_q01"]
                elif key in c.overall:
                    y = c.overall[key]
                else:
                    continue
                if scale == "log":  # the first update runs on the sampling weights: its drift is rounding
                    y = np.where((y > 0) & (c.updates > 1), y, np.nan)
                _plot_finite(ax, c.updates, y, color=colors(i % 10), marker="o", markersize=2.5, label=setting)
            if scale == "log":
                ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("optimizer step within the rollout batch")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        figure_title = (
            "Off-policy drift of every setting (token-weighted mean over all rollout steps and seeds; "
            "from the second optimizer step on)"
        )
        return _save(fig, path, figure_title)
    finally:
        plt.close(fig)


def estimator_figures(runs: Sequence[Run], out_dir: str | Path) -> dict[str, Path]:
    """Every estimator figure the runs have data for: ``weighting``, ``weighting_shapes``, ``variance``,
    ``offpolicy_compare`` and ``offpolicy/<setting>``; keys prefixed ``estimators/``."""
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    bins = weighting_by_setting(runs)
    for name, fn, arg in (("weighting", plot_weighting, bins), ("weighting_shapes", plot_weighting_shapes, bins)):
        p = fn(arg, out_dir / f"{name}.png")
        if p:
            written[f"estimators/{name}"] = p
    p = plot_variance(runs, out_dir / "variance.png")
    if p:
        written["estimators/variance"] = p
    curves = all_update_curves(runs)
    for setting, c in curves.items():
        p = plot_offpolicy(c, out_dir / f"offpolicy_{_slug(setting)}.png")
        if p:
            written[f"estimators/offpolicy/{setting}"] = p
    p = plot_offpolicy_comparison(curves, out_dir / "offpolicy_compare.png")
    if p:
        written["estimators/offpolicy_compare"] = p
    return written


def all_update_curves(runs: Sequence[Run]) -> dict[str, UpdateCurves]:
    out = {}
    for setting, group in group_runs(runs).items():
        if has_updates(group):
            c = update_curves(setting, group)
            if c is not None:
                out[setting] = c
    return out


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text).strip("_") or "setting"


# --- report section ---------------------------------------------------------------------------------


def weighting_table(b: WeightingBins) -> str:
    lines = [
        "| p | groups | measured mean W | closed form, group lengths | closed form, run lengths | share of weight |",
        "|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(b.p):
        if not b.n_groups[i]:
            continue
        exact = f"{b.closed_form_exact[i]:.4g}" if b.closed_form_exact is not None else "–"
        curve = f"{b.closed_form[i]:.4g}" if b.closed_form is not None else "–"
        lines.append(f"| {p:.3f} | {b.n_groups[i]} | {b.mean_weight[i]:.4g} | {exact} | {curve} | {b.share[i]:.3f} |")
    return "\n".join(lines)


def max_relative_deviation(b: WeightingBins) -> float | None:
    """Largest |measured - closed form with group lengths| / closed form over the bins with weight (None without a closed form)."""
    exact = b.closed_form_exact
    if not b.binary or exact is None:
        return None
    ok = (b.n_groups > 0) & (np.abs(exact) > 0)
    if not ok.any():
        return 0.0
    return float(np.max(np.abs(b.mean_weight[ok] - exact[ok]) / np.abs(exact[ok])))


def report_section(runs: Sequence[Run], rel: dict[str, str], level: str = "##") -> list[str]:
    """Markdown for the estimator diagnostics of ``runs``, linking the figures in ``rel`` (name -> relative path)."""
    md: list[str] = []
    bins = weighting_by_setting(runs)
    if bins:
        md += [
            f"{level} Difficulty weighting",
            "",
            "Each group's gradient weight W is the sum over its tokens of |advantage| x the aggregation's "
            "coefficient (1/(B n) for sequence normalisation, 1/C for constant), from the training-rollout dumps; "
            "groups are binned by pass rate p. The red curve is the closed form for 0/1 rewards with the run's "
            "group size, batch and constant (and, for constant normalisation, the mean lengths of correct and "
            "incorrect responses); with each group's own lengths the closed form is exact.",
            "",
        ]
        for key in ("estimators/weighting", "estimators/weighting_shapes"):
            if key in rel:
                md += [f"![{key.split('/')[-1]}]({rel[key]})", ""]
        for setting, b in bins.items():
            dev = max_relative_deviation(b)
            check = (
                ""
                if dev is None
                else f" Largest relative gap between measured and closed form (group lengths): {dev:.1e}."
            )
            md += [
                f"**{setting}**: {formula_text(b.est, b.correct_length, b.incorrect_length) if b.binary else 'no closed form'}."
                f"{check}",
                "",
                weighting_table(b),
                "",
            ]
    if has_variance(runs):
        md += [
            f"{level} Gradient variance with and without a baseline",
            "",
            "At the logged steps the rollout batch was re-scored before training under each advantage estimator "
            "(same rollouts, same weights). Variance is that of the batch gradient estimated from one group "
            "(the trace of its covariance across groups; 'projected': along the leave-one-out mean gradient of "
            "the other groups). "
            "The baseline bias ratio is J |mean baseline term|^2 / its variance: about 1 when the baseline adds "
            "zero-mean noise only. Score energy: squared norm per sample of the summed scores of a group's "
            "correct (E+) and incorrect (E-) samples; ratios are geometric means over the measurements, with "
            "their range. The mean baseline shrinks the correct samples' weight to 1-p and gives the incorrect "
            "ones p: if the two score sums were orthogonal it would change the second moment by "
            "(1-p)((1-p)+p E-/E+), more than 1 meaning more variance; the last column counts the measurements "
            "where the measured change has that sign.",
            "",
        ]
        if "estimators/variance" in rel:
            md += [f"![variance]({rel['estimators/variance']})", ""]
        md += [variance_table(runs), ""]
    curves = all_update_curves(runs)
    if curves:
        md += [
            f"{level} Off-policy diagnostics per optimizer step",
            "",
            "For every optimizer step of a rollout batch (x axis), over the tokens that went through the model: "
            "quantiles of the token ratio w = exp(logp - old) and of GSPO's sequence ratio, the share of tokens "
            f"(sequences) on which a PPO clip of {TOKEN_EPS:g} (a GSPO clip of {SEQ_EPS:g}) would take the "
            "clipped branch, the k3 estimate of KL(sampling || current), the entropy and the gradient norm. "
            "Colours split training into phases.",
            "",
        ]
        if "estimators/offpolicy_compare" in rel:
            md += [f"![offpolicy compare]({rel['estimators/offpolicy_compare']})", ""]
        md += [offpolicy_table(curves), ""]
        for setting in curves:
            key = f"estimators/offpolicy/{setting}"
            if key in rel:
                md += [f"{level}# {setting}", "", f"![offpolicy {setting}]({rel[key]})", ""]
    return md
