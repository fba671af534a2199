"""The CPU proof that RL learns: the `make demo` story, run as a test with its seeds fixed.

A small OLMo-2 is warm-started (SFT) on the arith task to partial competence, then GRPO (the real
`rlvr train` loop) must raise held-out validation accuracy by at least 20 points. About three
minutes on 2 cores.
"""

import json

import pytest


@pytest.mark.slow
def test_grpo_raises_validation_accuracy_by_20_points(tmp_path):
    from rlvr.commands.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(out=tmp_path, progress=False))
    assert result["rise_points"] >= 20, result
    assert result["after"] >= 2 * result["before"] or result["after"] - result["before"] >= 0.2
    # the warm start learned the content but not the strict format: GRPO must have fixed the format
    assert result["format_after"] > result["format_before"] + 0.2
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "demo.json").read_text())["rise_points"] == result["rise_points"]
    # the model the demo points `rlvr eval` at is the run's best: the highest validation, the later step on a tie
    assert result["model"] == str(tmp_path / "grpo" / "checkpoints" / "best" / "model")
    best = json.loads((tmp_path / "grpo" / "checkpoints" / "best" / "best.json").read_text())
    top = max(result["val_reward"])
    assert best["val/reward"] == top
    assert best["step"] == max(s for s, v in zip(result["val_steps"], result["val_reward"]) if v == top)
    # the validation at step 0 is the untrained warm start: before/after come from the same evaluator
    assert result["val_steps"][0] == 0 and result["val_steps"][-1] == 40
    # What the estimator did, from the same run: `rlvr report` draws the difficulty weighting of the
    # dumped rollouts against its closed form and the gradient variance with and without a baseline.
    from rlvr.experiments import load_runs
    from rlvr.experiments.estimators import max_relative_deviation, weighting_by_setting
    from rlvr.experiments.report import main as report_main

    assert report_main([str(tmp_path / "grpo"), "--out", str(tmp_path / "report.md")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## Difficulty weighting" in text and "## Gradient variance with and without a baseline" in text
    for name in ("weighting", "weighting_shapes", "variance"):
        assert (tmp_path / "report_figures" / "estimators" / f"{name}.png").stat().st_size > 10_000
    (bins,) = weighting_by_setting(load_runs(tmp_path / "grpo")).values()
    assert bins.n_groups.sum() == 8 * 8  # 8 dumps (every 5 of 40 steps) of 8 groups
    assert max_relative_deviation(bins) < 1e-4  # the dumped advantages follow the closed form of GRPO
