"""``rlvr report SWEEP_DIR --out report.md``: one Markdown page for a sweep (or any set of runs).

The page holds, in order: what was run (the sweep command, each setting's overrides, run status),
the table of final validation reward per setting (mean ± sample sd, 95 % t-interval of the mean,
min–max, n seeds, best and worst seed), the headline figures, final reward against learning rate
when lr varies, clip fractions of the off-policy settings, every other logged metric, what each
estimator did (difficulty weighting from the rollout dumps against its closed form, gradient
variance with and without a baseline, off-policy drift per optimizer step: see
``rlvr.experiments.estimators``), and sample rollouts of each setting's best seed before (first
dump) and after (last dump) training. Figures
are written next to the report in ``<stem>_figures/`` and linked relatively, so the report and
its figures can be committed together.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from rlvr.config import flatten
from rlvr.experiments.estimators import report_section
from rlvr.experiments.plot import BAND_LABEL, plot_runs
from rlvr.experiments.runs import BANDS, VAL_REWARD, Run, final_values, group_runs, load_runs, read_rollouts
from rlvr.training.health import summarize as summarize_health


def _num(x: float, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def final_table(runs: Sequence[Run], metric: str = VAL_REWARD) -> str:
    """Markdown table of the final ``metric`` per setting, best mean first."""
    finals = final_values(runs, metric)
    lines = [
        "| setting | mean ± sd | 95% CI of mean | min – max | n seeds | best seed | worst seed | at step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(finals.values(), key=lambda f: -f.mean if f.n else math.inf)
    for f in order:
        best, worst = f.best, f.worst
        if best is None or worst is None:  # no run logged the metric (f.n == 0)
            lines.append(f"| {f.setting} | – | – | – | 0 | – | – | – |")
            continue
        sd = f" ± {_num(f.std)}" if f.n > 1 else ""
        ci = f"± {_num(f.ci95)}" if f.n > 1 else "–"
        steps = sorted(set(f.steps.values()))
        at = str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]} (unequal!)"
        lines.append(
            f"| {f.setting} | {_num(f.mean)}{sd} | {ci} | {_num(f.min)} – {_num(f.max)} | {f.n} | "
            f"{best[0]}: {_num(best[1])} | {worst[0]}: {_num(worst[1])} | {at} |"
        )
    return "\n".join(lines)


def best_table(runs: Sequence[Run], metric: str = VAL_REWARD, tolerance: float = 0.05) -> str:
    """Markdown table of each setting's best ``metric`` over the run (mean over seeds), where the best
    fell, and how many seeds ended within ``tolerance`` of their own best (the run kept its gains)."""
    lines = [
        f"| setting | best mean ± sd | best min – max | step of the best per seed | final within {tolerance:g} of best |",
        "|---|---|---|---|---|",
    ]
    for setting, group in group_runs(runs).items():
        per_seed = []
        for r in group:
            vals = [(row["step"], row[metric]) for row in r.metrics if isinstance(row.get(metric), (int, float))]
            if vals:
                best = max(v for _, v in vals)
                per_seed.append((r.seed, best, max(s for s, v in vals if v == best), vals[-1][1]))
        if not per_seed:
            continue
        bests = [b for _, b, _, _ in per_seed]
        sd = f" ± {_num(statistics.stdev(bests))}" if len(bests) > 1 else ""
        steps = ", ".join(f"{seed}: {step}" for seed, _, step, _ in per_seed)
        kept = sum(best - final <= tolerance for _, best, _, final in per_seed)
        lines.append(
            f"| {setting} | {_num(statistics.mean(bests))}{sd} | {_num(min(bests))} – {_num(max(bests))} | {steps} | "
            f"{kept}/{len(per_seed)} |"
        )
    return "\n".join(lines)


def health_table(runs: Sequence[Run]) -> str:
    """Markdown table of the health warnings the runs logged (``rlvr.training.health``), per setting and signal;
    empty when no run warned."""
    rows = []
    for setting, group in group_runs(runs).items():
        by_signal: dict[str, list[tuple[int | None, dict]]] = {}
        for r in group:
            for signal, entry in summarize_health([h for row in r.metrics for h in row.get("health") or []]).items():
                by_signal.setdefault(signal, []).append((r.seed, entry))
        for signal, entries in sorted(by_signal.items()):
            firsts = ", ".join(f"{seed}: {e['first_step']}" for seed, e in entries)
            message = entries[0][1]["message"].replace("|", "/")
            rows.append(f"| {setting} | {signal} | {len(entries)}/{len(group)} | {firsts} | {message} |")
    if not rows:
        return ""
    head = [
        "| setting | signal | seeds that warned | first warning per seed (step) | first message |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + rows)


def status_table(runs: Sequence[Run]) -> str:
    lines = ["| setting | seeds | finished | last step per seed |", "|---|---|---|---|"]
    for setting, group in group_runs(runs).items():
        seeds = ", ".join(str(r.seed) for r in group)
        steps = ", ".join(f"{r.seed}: {r.last_step}" for r in group)
        lines.append(f"| {setting} | {seeds} | {sum(r.finished for r in group)}/{len(group)} | {steps} |")
    return "\n".join(lines)


def _fence(text: str) -> str:
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return "`" * max(3, longest + 1)


def _clip(text: str, limit: int, keep: str = "head") -> str:
    text = str(text)
    if len(text) <= limit:
        return text
    return ("…" + text[-limit:]) if keep == "tail" else (text[:limit] + "…")


def pick_samples(rows: list[dict], k: int) -> list[dict]:
    """Up to ``k`` rollouts, alternating rewarded and unrewarded ones when both exist (in dump order)."""
    good = [r for r in rows if float(r.get("reward", 0) or 0) > 0]
    bad = [r for r in rows if float(r.get("reward", 0) or 0) <= 0]
    out: list[dict] = []
    while len(out) < k and (good or bad):
        for pool in (good, bad):
            if pool and len(out) < k:
                out.append(pool.pop(0))
    return out


def _printable(text: str) -> str:
    """Control characters (an untrained model emits them) as escapes, so they cannot garble the page."""
    return "".join(ch if ch in "\n\t" or (ch.isprintable() and ch != "\ufffd") else repr(ch)[1:-1] for ch in str(text))


def format_rollout(row: dict, prompt_chars: int = 400, response_chars: int = 1200) -> str:
    """One rollout as Markdown: ground truth and scores, the question (or the prompt's end), the response."""
    if row.get("question"):
        asked = ("question", _clip(row["question"], prompt_chars))
    else:
        asked = ("prompt (end)", _clip(row.get("prompt", ""), prompt_chars, keep="tail"))
    response = _clip(row.get("response", ""), response_chars)
    scores = ", ".join(f"{k} {row[k]}" for k in ("reward", "format_reward") if k in row)
    parts = [f"*ground truth* `{_printable(row.get('ground_truth', '?'))}` — {scores}", ""]
    for title, text in (asked, ("response", response)):
        text = _printable(text)
        fence = _fence(text)
        parts += [f"{title}:", "", fence + "text", text, fence, ""]
    return "\n".join(parts)


def rollout_section(runs: Sequence[Run], k: int = 2, metric: str = VAL_REWARD) -> str:
    """Per setting, samples from the best seed's first and last dumps: validation samples when the run
    wrote them (the first is the untrained policy), else training rollouts."""
    finals = final_values(runs, metric)
    out = []
    for setting, group in group_runs(runs).items():
        best = finals[setting].best
        chosen = next((r for r in group if best and (f"seed_{r.seed}" == best[0] or r.path.name == best[0])), group[0])
        kind = "val" if chosen.rollout_dumps("val") else "train"
        dumps = chosen.rollout_dumps(kind)
        out.append(f"### {setting} ({chosen.label})\n")
        if not dumps:
            out.append("_no rollout dumps in this run_\n")
            continue
        picks = [("before", dumps[0])] + ([("after", dumps[-1])] if len(dumps) > 1 else [])
        for when, (step, path) in picks:
            rows = read_rollouts(path)
            mean = sum(float(r.get("reward", 0) or 0) for r in rows) / max(len(rows), 1)
            what = "validation samples" if kind == "val" else "training rollouts"
            out.append(f"**{when} — step {step}** ({len(rows)} {what} in the dump, mean reward {mean:.2f})\n")
            for row in pick_samples(rows, k):
                out.append(format_rollout(row))
    return "\n".join(out)


def _settings_section(sweep: dict | None) -> str:
    if not sweep or not sweep.get("settings"):
        return ""
    lines = ["| setting | overrides |", "|---|---|"]
    for name, over in sweep["settings"].items():
        text = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in flatten(over).items()) or "(base config)"
        lines.append(f"| {name} | {text} |")
    return "\n".join(lines)


def _figures_md(rel: dict[str, str], level: str) -> list[str]:
    """Markdown for one set of figures: overview, lr, clip fractions, then every other metric."""
    md = []
    if "overview" in rel:
        md += [f"{level} Overview", "", f"![overview]({rel['overview']})", ""]
    if "final_vs_lr" in rel:
        md += [
            f"{level} Final validation reward vs learning rate",
            "",
            f"![final reward vs lr]({rel['final_vs_lr']})",
            "",
        ]
    clip = [m for m in rel if "clip_fraction" in m]
    if clip:
        md += [f"{level} Clip fractions (off-policy settings)", ""]
        md += [f"![{m}]({rel[m]})" for m in clip] + [""]
    shown = {"overview", "final_vs_lr", *clip, *(m for m in rel if m.startswith("estimators/"))}
    rest = [m for m in rel if m not in shown]
    if rest:
        md += [f"{level} All metrics", ""]
        for m in rest:
            md += [f"{level}# {m}", "", f"![{m}]({rel[m]})", ""]
    return md


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text).strip("_") or "part"


def write_report(
    paths: Sequence[str | Path],
    out: str | Path,
    band: str = "minmax",
    metrics: Sequence[str] | None = None,
    smoothing: int = 1,
    samples: int = 2,
    title: str | None = None,
    command: str | None = None,
) -> Path:
    """Write the Markdown report for the runs under ``paths`` to ``out`` (figures alongside); returns ``out``.

    With several sweep directories (say the on-policy and the off-policy study) the table, settings
    and rollouts cover all of them, and each directory gets its own section of figures. Settings
    with the same name in two directories are told apart as ``<dir>/<setting>``.
    """
    out = Path(out)
    dirs = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    parts = [(p, load_runs(p)) for p in dirs]
    names = [r.setting for _, runs in parts for r in {r.setting: r for r in runs}.values()]
    prefixed = len(names) != len(set(names))
    if prefixed:
        for p, part in parts:
            for r in part:
                r.setting = f"{p.name}/{r.setting}"
    runs = [r for _, part in parts for r in part]
    sweeps = []
    for p in dirs:
        if (p / "sweep.json").is_file():
            record = json.loads((p / "sweep.json").read_text())
            if prefixed:
                record["settings"] = {f"{p.name}/{k}": v for k, v in record.get("settings", {}).items()}
            sweeps.append(record)
    groups = group_runs(runs)
    fig_dir = out.parent / f"{out.stem}_figures"

    sweep_names = [s.get("name") for s in sweeps if s.get("name")]
    md = [f"# {title or ' + '.join(sweep_names) or 'rlvr report'}", ""]
    md.append(
        f"{len(runs)} runs in {len(groups)} settings. Generated "
        f"{_dt.date.today().isoformat()} by `{command or 'rlvr report'}`."
    )
    cmds = list(dict.fromkeys(inv["command"] for s in sweeps for inv in s.get("invocations", [])))
    if cmds:
        md += ["", "Sweep command(s):", "", "```", *cmds, "```"]
    md += ["", f"Bands in every figure: {BAND_LABEL[band]}; thin faint lines are the individual seeds.", ""]

    md += [
        "## Final validation reward",
        "",
        final_table(runs),
        "",
        "sd is the sample standard deviation across seeds; the 95 % interval is Student-t on the mean. "
        "When two settings' min–max ranges overlap, these seeds do not separate them.",
        "",
    ]
    md += [
        "## Best validation reward",
        "",
        best_table(runs),
        "",
        "The best validation reward each seed reached at any evaluation (the model `checkpoints/best` keeps), "
        "and how many seeds ended within 5 points of their own best.",
        "",
    ]
    health_md = health_table(runs)
    md += ["## Health warnings", "", health_md or "No run logged a health warning.", ""]
    settings_md = _settings_section({"settings": {k: v for s in sweeps for k, v in s.get("settings", {}).items()}})
    if settings_md:
        md += ["## Settings", "", settings_md, ""]
    md += ["## Runs", "", status_table(runs), ""]

    for i, (path, part) in enumerate(parts):
        sub = fig_dir if len(parts) == 1 else fig_dir / _slug(f"{i}_{path.name}")
        figures = plot_runs(part, sub, metrics=metrics, band=band, smoothing=smoothing)
        rel = {name: p.relative_to(out.parent).as_posix() for name, p in figures.items()}
        if len(parts) == 1:
            md += _figures_md(rel, "##") + report_section(part, rel, "##")
        else:
            md += [f"## Figures: {path.name}", ""] + _figures_md(rel, "###") + report_section(part, rel, "###")
    md += [
        "## Sample rollouts: before and after training",
        "",
        "From each setting's best seed (by final validation reward): its first and last dumps of validation "
        "samples (step 0 is the untrained policy), or of training rollouts when it wrote no validation samples.",
        "",
        rollout_section(runs, k=samples),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlvr report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="a sweep directory (or run/sweep directories)")
    parser.add_argument("--out", type=Path, required=True, help="the Markdown file to write (figures go beside it)")
    parser.add_argument("--band", choices=BANDS, default="minmax", help="spread across seeds (default minmax)")
    parser.add_argument("--metrics", nargs="+", help="only these per-metric figures (default: all)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving average over this many steps per run")
    parser.add_argument("--samples", type=int, default=2, help="rollouts shown per dump")
    parser.add_argument("--title", help="report title (default: the sweep's name)")
    args = parser.parse_args(argv)
    try:
        path = write_report(
            args.paths,
            args.out,
            band=args.band,
            metrics=args.metrics,
            smoothing=args.smooth,
            samples=args.samples,
            title=args.title,
            command=shlex.join(["rlvr", "report", *argv]),
        )
    except FileNotFoundError as e:
        print(f"rlvr report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
