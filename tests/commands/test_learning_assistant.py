"""The CPU proof that instruction tuning and DPO do their jobs (`rlvr.experiments.sft_dpo_proof`), run
as a test with its defaults: three seeds, each an SFT from a fresh model and a DPO run on
correct-vs-wrong pairs, on the synthetic arith task. A few minutes on 2 cores."""

import json

import pytest


@pytest.mark.slow
def test_sft_then_dpo_each_do_their_job(tmp_path):
    from rlvr.experiments.sft_dpo_proof import ProofConfig, run_proof

    summary = run_proof(ProofConfig(out=tmp_path))
    assert [s["seed"] for s in summary["seeds"]] == [0, 1, 2]
    for s in summary["seeds"]:
        # SFT from a fresh model teaches the task ...
        assert s["accuracy_fresh"] <= 0.05 and s["accuracy_sft"] >= s["accuracy_fresh"] + 0.2, s
        # ... DPO ranks held-out pairs right and raises task accuracy by at least 10 points
        assert s["val_preference_accuracy"] >= 0.9, s
        assert s["accuracy_dpo"] >= s["accuracy_sft"] + 0.10, s
        # by removing the flaw the SFT data taught (the restated starting amount)
        assert s["restated_dpo"] < s["restated_sft"] / 2, s
    assert (tmp_path / "proof.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "proof.json").read_text())["mean"]["accuracy_dpo"] == pytest.approx(
        sum(s["accuracy_dpo"] for s in summary["seeds"]) / 3
    )
