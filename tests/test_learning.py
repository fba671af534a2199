"""The CPU proof that RL learns: the `make demo` story, run as a test with its seeds fixed.

A small OLMo-2 is warm-started (SFT) on the arith task to partial competence, then GRPO (the real
`rlvr train` loop) must raise held-out validation accuracy by at least 20 points. About three
minutes on 2 cores.
"""

import json

import pytest


@pytest.mark.slow
def test_grpo_raises_validation_accuracy_by_20_points(tmp_path):
    from rlvr.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(out=tmp_path, progress=False))
    assert result["rise_points"] >= 20, result
    assert result["after"] >= 2 * result["before"] or result["after"] - result["before"] >= 0.2
    # the warm start learned the content but not the strict format: GRPO must have fixed the format
    assert result["format_after"] > result["format_before"] + 0.2
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "demo.json").read_text())["rise_points"] == result["rise_points"]
    # the validation at step 0 is the untrained warm start: before/after come from the same evaluator
    assert result["val_steps"][0] == 0 and result["val_steps"][-1] == 40
