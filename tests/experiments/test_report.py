"""CPU tests for ``rlvr report``: the Markdown holds the final-reward table (hand values), links to
figures that exist and are non-trivial PNGs, and sample rollouts before and after training."""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_plot import hand_sweep, write_run

from rlvr.experiments.report import format_rollout, pick_samples
from rlvr.experiments.report import main as report_main


def _sweep_with_rollouts(root: Path) -> Path:
    hand_sweep(root)
    run = root / "a" / "seed_1"  # the best seed of setting a (final val 0.7)
    before = [
        {
            "question": "Mia has 7 apples. She eats 2. How many now?",
            "prompt": "...",
            "response": "\x07garbage```",
            "ground_truth": "5",
            "reward": 0.0,
            "format_reward": 0.0,
        }
    ]
    after = [
        {
            "question": "Tom has 3 cards. He finds 4 more. How many now?",
            "prompt": "...",
            "response": " 3 + 4 = 7. </think> <answer> 7 </answer>",
            "ground_truth": "7",
            "reward": 1.0,
            "format_reward": 1.0,
        },
        {"question": "Q2", "response": "wrong", "ground_truth": "1", "reward": 0.0},
    ]
    for step, rows in ((0, before), (2, after)):
        (run / "rollouts").mkdir(exist_ok=True)
        (run / "rollouts" / f"val_step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "sweep.json").write_text(
        json.dumps(
            {
                "name": "hand sweep",
                "settings": {"a": {"optim.lr": 1e-5}, "b": {"optim": {"lr": 3e-5}}},
                "invocations": [{"command": "rlvr sweep spec.yaml --out sweep"}],
            }
        )
    )
    return root


def test_report_renders_table_figures_and_rollouts(tmp_path):
    root = _sweep_with_rollouts(tmp_path / "sweep")
    out = tmp_path / "docs" / "report.md"
    assert report_main([str(root), "--out", str(out)]) == 0
    text = out.read_text()

    assert text.startswith("# hand sweep\n")
    assert "rlvr sweep spec.yaml --out sweep" in text
    # Setting a: final val 0.5, 0.7, 0.6 -> mean 0.6, sd 0.1, t(2) * 0.1 / sqrt(3) = 0.248; b: 0.2, 0.3
    row_a = next(l for l in text.splitlines() if l.startswith("| a |"))
    assert row_a == "| a | 0.600 ± 0.100 | ± 0.248 | 0.500 – 0.700 | 3 | seed_1: 0.700 | seed_0: 0.500 | 2 |"
    row_b = next(l for l in text.splitlines() if l.startswith("| b |") and "±" in l)
    assert "0.250 ± 0.071" in row_b and "| 2 | seed_1: 0.300 | seed_0: 0.200 |" in row_b
    assert text.index("| a |") < text.index("| b |")  # best mean first
    assert "| a | `optim.lr=1e-05` |" in text

    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert "report_figures/overview.png" in links and "report_figures/train_clip_fraction.png" in links
    assert "report_figures/final_val_reward_vs_lr.png" in links
    for link in links:
        data = (out.parent / link).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 15_000, link
    assert text.index("## Clip fractions") < text.index("## All metrics")

    rollouts = text[text.index("## Sample rollouts") :]
    assert "### a (a/seed_1)" in rollouts
    assert "**before — step 0** (1 validation samples" in rollouts
    assert "**after — step 2** (2 validation samples in the dump, mean reward 0.50)" in rollouts
    assert "<answer> 7 </answer>" in rollouts and "Tom has 3 cards" in rollouts
    assert "\\x07garbage```" in rollouts and "\x07" not in rollouts  # control chars escaped
    assert "````text\n\\x07garbage```\n````" in rollouts  # fence longer than the backticks inside
    assert "_no rollout dumps in this run_" in rollouts  # setting b wrote none


def test_pick_samples_alternates_rewarded_and_not():
    rows = [{"reward": 0.0, "i": 0}, {"reward": 0.0, "i": 1}, {"reward": 1.0, "i": 2}, {"reward": 1.0, "i": 3}]
    assert [r["i"] for r in pick_samples(rows, 3)] == [2, 0, 3]
    assert [r["i"] for r in pick_samples(rows[:2], 5)] == [0, 1]


def test_format_rollout_uses_prompt_tail_without_question():
    text = format_rollout(
        {"prompt": "x" * 1000 + "END", "response": "r", "ground_truth": "1", "reward": 1.0}, prompt_chars=10
    )
    assert "prompt (end):" in text and "…xxxxxxxEND" in text


def test_report_on_runs_without_sweep_record(tmp_path):
    write_run(tmp_path / "r1", [{"step": 0, "train/reward": 0.1, "val/reward": 0.2}], {"seed": 0, "name": "solo"})
    out = tmp_path / "r.md"
    assert report_main([str(tmp_path / "r1"), "--out", str(out), "--title", "One run"]) == 0
    text = out.read_text()
    assert text.startswith("# One run") and "| solo | 0.200 | – | 0.200 – 0.200 | 1 |" in text


def test_one_report_for_two_sweeps(tmp_path):
    """The on-policy and off-policy studies in one report: one table, a figure section per sweep, and
    settings with the same name in both told apart by their directory."""
    hand_sweep(tmp_path / "onpolicy")
    hand_sweep(tmp_path / "offpolicy")
    for name in ("onpolicy", "offpolicy"):
        (tmp_path / name / "sweep.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "settings": {"a": {"x": 1}, "b": {}},
                    "invocations": [{"command": f"rlvr sweep {name}.yaml"}],
                }
            )
        )
    out = tmp_path / "both.md"
    assert report_main([str(tmp_path / "onpolicy"), str(tmp_path / "offpolicy"), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# onpolicy + offpolicy")
    assert "rlvr sweep onpolicy.yaml" in text and "rlvr sweep offpolicy.yaml" in text
    assert "| onpolicy/a | 0.600 ± 0.100 |" in text and "| offpolicy/a | 0.600 ± 0.100 |" in text
    assert "| onpolicy/a | `x=1` |" in text
    assert "## Figures: onpolicy" in text and "## Figures: offpolicy" in text
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (out.parent / link).is_file(), link
    assert "both_figures/0_onpolicy/overview.png" in text and "both_figures/1_offpolicy/overview.png" in text


def test_best_table_hand_values_and_runs_that_fell_from_their_best(tmp_path):
    from test_plot import write_run as write

    from rlvr.experiments.report import best_table
    from rlvr.experiments.runs import load_runs

    root = hand_sweep(tmp_path / "sweep")
    rows = [{"step": 0, "val/reward": 0.1}, {"step": 1, "val/reward": 0.8}, {"step": 2, "val/reward": 0.6}]
    write(root / "c" / "seed_0", rows, {"seed": 0})
    ties = [{"step": 0, "val/reward": 0.4}, {"step": 1, "val/reward": 0.4}, {"step": 2, "val/reward": 0.38}]
    write(root / "c" / "seed_1", ties, {"seed": 1})
    lines = best_table(load_runs(root)).splitlines()
    # a: bests 0.5, 0.7, 0.6 (mean 0.6, sd 0.1), each the final value; b: 0.2, 0.3.
    assert lines[2] == "| a | 0.600 ± 0.100 | 0.500 – 0.700 | 0: 2, 1: 2, 2: 2 | 3/3 |"
    assert lines[3] == "| b | 0.250 ± 0.071 | 0.200 – 0.300 | 0: 2, 1: 2 | 2/2 |"
    # c: seed 0 peaked at 0.8 and ended 0.2 below it; seed 1's tie goes to the later step.
    assert lines[4] == "| c | 0.600 ± 0.283 | 0.400 – 0.800 | 0: 1, 1: 1 | 1/2 |"


def test_report_lists_the_health_warnings(tmp_path):
    from test_plot import write_run as write

    from rlvr.experiments.report import health_table
    from rlvr.experiments.runs import load_runs

    warned = {"signal": "val_drop", "step": 2, "message": "val/reward 0.6 is 0.2 below its best"}
    write(
        tmp_path / "s" / "x" / "seed_0", [{"step": 1, "val/reward": 0.8}, {"step": 2, "health": [warned]}], {"seed": 0}
    )
    write(tmp_path / "s" / "x" / "seed_1", [{"step": 1, "val/reward": 0.8}], {"seed": 1})
    table = health_table(load_runs(tmp_path / "s"))
    assert table.splitlines()[2] == "| x | val_drop | 1/2 | 0: 2 | val/reward 0.6 is 0.2 below its best |"
    out = tmp_path / "report.md"
    assert report_main([str(tmp_path / "s"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Health warnings" in text and "| x | val_drop | 1/2 |" in text
    assert "## Best validation reward" in text
    assert health_table(load_runs(hand_sweep(tmp_path / "quiet"))) == ""
