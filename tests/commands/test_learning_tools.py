"""The CPU proof that GRPO learns to use a tool: ``rlvr.experiments.tool_proof`` with its seeds fixed.

A small OLMo-2 is warm-started (SFT) on arith solutions of which 30 % call the calculator and the rest
compute by hand (half of those with a slip); GRPO with ``env.name tool`` must then raise both the
held-out accuracy and the calculator calls per answer, each measured by the trainer's validation
through the same environment. One run (seed 0, one thread): calls per answer 0.18 -> 0.80, accuracy
21 % -> 28 %.
"""

import json

import pytest


@pytest.mark.slow
def test_grpo_with_a_calculator_raises_tool_use_and_accuracy(tmp_path):
    from rlvr.experiments.tool_proof import ToolProofConfig, run_tool_proof

    result = run_tool_proof(ToolProofConfig(out=tmp_path))
    assert result["val_steps"] == [0, 30], result
    assert result["tool_calls_after"] >= result["tool_calls_before"] + 0.3, result
    assert result["accuracy_after"] > result["accuracy_before"], result
    assert json.loads((tmp_path / "tool_proof.json").read_text()) == result
    dump = [json.loads(line) for line in (tmp_path / "grpo" / "rollouts" / "step_30.jsonl").read_text().splitlines()]
    called = [d for d in dump if d["turns"] == 2]
    assert called, "no conversation called the calculator at the last step"
    for d in called:  # the tool's result is in the conversation, never among the trained tokens
        assert [m["role"] for m in d["messages"]][-3:] == ["assistant", "tool", "assistant"]
