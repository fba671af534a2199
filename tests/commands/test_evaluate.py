"""`rlvr eval` and the library ``evaluate``: hand-worked metrics on scripted responses, and an
end-to-end CLI run on a tiny model over GSM8K test rows."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from rlvr.commands.evaluate import evaluate
from rlvr.engines.base import Completion, SamplingParams
from rlvr.task.data import Example


class ScriptedEngine:
    """Answers the i-th prompt with ``responses[i]``; records the params it was called with."""

    def __init__(self, responses):
        self.responses = responses
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((list(prompts), params))
        out = []
        for _ in prompts:
            text, reason = self.responses[len([q for c in self.calls[:-1] for q in c[0]]) + len(out)]
            out.append(
                [
                    Completion(text=text, token_ids=list(range(len(text.split()))), finish_reason=reason)
                    for _ in range(params.n)
                ]
            )
        return out

    def sync_weights(self, model):
        return {}

    def close(self):
        pass


def test_metrics_and_categories_worked_by_hand():
    examples = [Example(f"q{i}", truth) for i, truth in enumerate(["72", "10", "5", "3"])]
    engine = ScriptedEngine(
        [
            ("reason </think> <answer> 72 </answer>", "stop"),  # correct, 7 "tokens"
            ("reason </think> <answer> 11 </answer>", "stop"),  # formatted, wrong
            ("no tags at all, 5", "length"),  # unformatted, truncated
            ("x </think> <answer> $3 </answer>", "stop"),  # correct
        ]
    )
    metrics, samples = evaluate(None, None, examples, "r1_zero", engine, SamplingParams(n=1, seed=0), chunk_size=3)
    assert metrics["n"] == 4
    assert metrics["categories"] == {"correct": 2, "formatted_wrong": 1, "unformatted": 1}
    assert metrics["accuracy"] == pytest.approx(0.5)
    assert metrics["format_rate"] == pytest.approx(0.75)
    assert metrics["truncated_rate"] == pytest.approx(0.25)
    assert metrics["mean_response_length"] == pytest.approx((5 + 5 + 5 + 5) / 4)
    # the prompt owns its stop string, kept in the output; chunks get consecutive seeds
    assert [c[1].stop for c in engine.calls] == [("</answer>",), ("</answer>",)]
    assert [c[1].seed for c in engine.calls] == [0, 1] and all(c[1].include_stop_str_in_output for c in engine.calls)
    assert engine.calls[0][0][0].endswith("Assistant: <think>") and "q0" in engine.calls[0][0][0]
    assert [s["category"] for s in samples] == ["correct", "formatted_wrong", "unformatted", "correct"]
    assert samples[1]["ground_truth"] == "10" and samples[2]["finish_reason"] == "length"


def test_question_only_prompt_has_no_stop_and_grades_boxed():
    examples = [Example("q", "18")]
    engine = ScriptedEngine([("so \\boxed{18}", "length")])
    metrics, samples = evaluate(None, None, examples, "question_only", engine, SamplingParams(n=2))
    assert engine.calls[0][1].stop == ()
    assert metrics["n"] == 2 and metrics["categories"]["correct"] == 2


@pytest.fixture()
def tiny_model_dir(tmp_path, tiny_model, tiny_tokenizer):
    path = tmp_path / "tiny-model"
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_rlvr_eval_end_to_end(tmp_path, tiny_model_dir, gsm8k_path, capsys):
    from rlvr.cli import main

    out = tmp_path / "eval"
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "r1_zero",
            "--prompt",
            "question_only",
            "--data",
            str(gsm8k_path),
            "--split",
            "test",
            "--limit",
            "8",
            "--out",
            str(out),
            "--max-tokens",
            "16",
            "--n",
            "2",
            "--device",
            "cpu",
            "--batch-size",
            "8",
            "--seed",
            "1",
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"r1_zero", "question_only"}
    assert results["config"]["limit"] == 8 and results["config"]["prompt"] == ["r1_zero", "question_only"]
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 8 * 2
    for name, m in results["results"].items():
        assert set(m) >= {
            "n",
            "accuracy",
            "format_rate",
            "mean_response_length",
            "truncated_rate",
            "categories",
            "tokens_per_s",
            "time_s",
        }
        assert m["n"] == 16 and sum(m["categories"].values()) == m["n"]
        mine = [s for s in lines if s["prompt_name"] == name]
        assert m["accuracy"] == pytest.approx(sum(s["reward"] for s in mine) / 16)
        assert m["format_rate"] == pytest.approx(1 - m["categories"]["unformatted"] / 16)
        assert m["mean_response_length"] == pytest.approx(sum(s["num_tokens"] for s in mine) / 16)
        assert 0 < m["mean_response_length"] <= 16
        assert m["truncated_rate"] == pytest.approx(sum(s["finish_reason"] == "length" for s in mine) / 16)
    assert {"prompt", "response", "ground_truth", "reward", "format_reward", "finish_reason"} <= set(lines[0])
    assert "rlvr eval" in capsys.readouterr().out
    # same seed and batch size, same run (the batch layout decides which draws each row gets)
    out2 = tmp_path / "eval2"
    main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--prompt",
            "r1_zero",
            "--data",
            str(gsm8k_path),
            "--limit",
            "8",
            "--out",
            str(out2),
            "--max-tokens",
            "16",
            "--n",
            "2",
            "--device",
            "cpu",
            "--seed",
            "1",
            "--batch-size",
            "8",
        ]
    )
    again = [json.loads(x) for x in (out2 / "samples.jsonl").read_text().splitlines()]
    assert [s["response"] for s in again] == [s["response"] for s in lines if s["prompt_name"] == "r1_zero"]


class PerSampleEngine(ScriptedEngine):
    """Answers sample j of the i-th prompt with ``responses[i][j]``."""

    def generate(self, prompts, params):
        done = sum(len(c[0]) for c in self.calls)
        self.calls.append((list(prompts), params))
        return [
            [Completion(text=t, token_ids=[1], finish_reason="stop") for t in self.responses[done + i][: params.n]]
            for i in range(len(prompts))
        ]


def test_pass_at_k_and_avg_at_k_worked_by_hand():
    """Question 0 has 1 correct sample of 4, question 1 has 2. avg@4 = 3/8; pass@1 = (1/4 + 2/4) / 2;
    pass@2 = 1 - C(n-c, 2) / C(4, 2) averaged: (1 - 3/6 + 1 - 1/6) / 2 = 2/3; pass@4 = 1."""
    right, wrong = "r </think> <answer> 7 </answer>", "r </think> <answer> 8 </answer>"
    engine = PerSampleEngine([[right, wrong, wrong, wrong], [wrong, right, right, wrong]])
    metrics, _ = evaluate(None, None, [Example("a", "7"), Example("b", "7")], "r1_zero", engine, SamplingParams(n=4))
    assert metrics["avg_at_k"] == pytest.approx(3 / 8) == pytest.approx(metrics["accuracy"])
    assert metrics["pass_at_k"] == pytest.approx({"1": 3 / 8, "2": 2 / 3, "4": 1.0})
    # k that is not a power of two is reported too
    engine = PerSampleEngine([[wrong, right, wrong]])
    metrics, _ = evaluate(None, None, [Example("a", "7")], "r1_zero", engine, SamplingParams(n=3))
    assert metrics["pass_at_k"] == pytest.approx({"1": 1 / 3, "2": 2 / 3, "3": 1.0})
    metrics, _ = evaluate(None, None, [Example("a", "7")], "r1_zero", PerSampleEngine([[right]]), SamplingParams(n=1))
    assert "pass_at_k" not in metrics  # one sample: pass@1 is the accuracy


def test_rlvr_eval_on_hf_fast_equals_hf_greedy(tmp_path, tiny_model_dir, gsm8k_path):
    """`rlvr eval --engine hf-fast` (the SDPA path on a CPU) gives the plain engine's greedy answers, as does
    ``--engine auto`` (which picks hf-fast for this OLMo-2 model), and ``--n`` adds pass@k and avg@k to
    results.json."""
    from rlvr.cli import main

    runs = {}
    for engine in ("hf", "hf-fast", "auto"):
        out = tmp_path / engine
        assert (
            main(
                [
                    "eval",
                    "--model",
                    str(tiny_model_dir),
                    "--data",
                    str(gsm8k_path),
                    "--limit",
                    "4",
                    "--out",
                    str(out),
                    "--max-tokens",
                    "12",
                    "--n",
                    "2",
                    "--temperature",
                    "0",
                    "--device",
                    "cpu",
                    "--engine",
                    engine,
                ]
            )
            == 0
        )
        runs[engine] = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        m = json.loads((out / "results.json").read_text())["results"]["r1_zero"]
        assert set(m["pass_at_k"]) == {"1", "2"} and m["avg_at_k"] == pytest.approx(m["categories"]["correct"] / 8)
    assert [s["response"] for s in runs["hf-fast"]] == [s["response"] for s in runs["hf"]]
    assert [s["response"] for s in runs["auto"]] == [s["response"] for s in runs["hf"]]


def test_greedy_decoding_sampled_n_times_warns(tmp_path, tiny_model_dir):
    from rlvr.commands.evaluate import EvalConfig, check_args

    cfg = EvalConfig(model=str(tiny_model_dir), out=tmp_path / "e", temperature=0.0, n=4)
    with pytest.warns(UserWarning, match="--temperature 0 is greedy decoding: the --n 4 samples"):
        check_args(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_args(dataclasses.replace(cfg, n=1))
        check_args(dataclasses.replace(cfg, temperature=0.7))
