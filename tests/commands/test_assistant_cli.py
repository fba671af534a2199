"""The assistant half from the command line, as a user runs it: `rlvr sft instruct` from a fresh tiny
model, `rlvr dpo` from that checkpoint, and `rlvr eval --suite` on the DPO model with the SFT model
as the judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def test_sft_then_dpo_then_eval_from_the_command_line(tmp_path):
    from rlvr.cli import main

    if not (SHARED_DATA / "mmlu").is_dir():
        pytest.skip("../shared/data not found")
    sft_data, pairs = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    with sft_data.open("w") as f:
        for i in range(60):
            f.write(
                json.dumps({"prompt": f"Add {i % 5} and {i % 3}.", "response": f"The sum is {i % 5 + i % 3}."}) + "\n"
            )
    with pairs.open("w") as f:
        for i in range(12):
            f.write(
                json.dumps(
                    {"prompt": f"Add {i % 5} and 1.", "chosen": f"The sum is {i % 5 + 1}.", "rejected": "I will not."}
                )
                + "\n"
            )
    assert (
        main(
            [
                "sft",
                "instruct",
                "--model",
                "tiny",
                "--data",
                str(sft_data),
                "--out",
                str(tmp_path / "sft"),
                "--seq-length",
                "32",
                "--batch-size",
                "4",
                "--steps",
                "3",
                "--val-size",
                "8",
                "--lr",
                "1e-3",
                "--vocab-size",
                "300",
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "dpo",
                "--model",
                str(tmp_path / "sft"),
                "--data",
                str(pairs),
                "--out",
                str(tmp_path / "dpo"),
                "--val-size",
                "4",
                "--batch-size",
                "4",
                "--steps",
                "2",
                "--eval-every",
                "1",
                "--lr",
                "1e-4",
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (tmp_path / "dpo" / "best" / "model.safetensors").is_file()
    assert (
        main(
            [
                "eval",
                "--suite",
                "mmlu",
                "gsm8k",
                "alpaca_eval",
                "sst",
                "--model",
                str(tmp_path / "dpo" / "best"),
                "--mode",
                "finetuned",
                "--data-dir",
                str(SHARED_DATA),
                "--limit",
                "8",
                "--max-tokens",
                "4",
                "--judge",
                str(tmp_path / "sft"),
                "--judge-max-tokens",
                "2",
                "--device",
                "cpu",
                "--judge-device",
                "cpu",
                "--no-progress",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 0
    )
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    assert [results[s]["n"] for s in ("mmlu", "gsm8k", "alpaca_eval", "sst")] == [8, 8, 8, 8]
    assert results["alpaca_eval"]["scored"] and results["sst"]["scored"]
    outputs = json.loads((tmp_path / "eval" / "alpaca_eval_outputs.json").read_text())
    assert {o["generator"] for o in outputs} == {"best"}
