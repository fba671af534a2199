"""The assistant suites: parsers on the tricky cases, the two prompting modes written out, grading and
metrics on scripted outputs, the judges (pairwise in both orders, length control, safety, an
OpenAI-compatible endpoint) and `rlvr eval --suite ...` end to end on a tiny local model."""

from __future__ import annotations

import csv
import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from rlvr import parse_gsm8k_response, parse_mmlu_response
from rlvr.engines.base import Completion
from rlvr.errors import UserError
from rlvr.suites.judge import (
    EndpointJudge,
    judge_alpaca_eval,
    judge_sst,
    length_controlled_win_rate,
    parse_choice,
    parse_unsafe,
)
from rlvr.suites.parsing import same_number
from rlvr.suites.run import SUITES, clean_output, format_table, run_suite, wrap_prompt

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MMLU_EXAMPLE = {
    "subject": "virology",
    "question": "How many human polyomaviruses are known at present?",
    "options": ["100", "1", "10", "unknown"],
    "answer": "A",
}


# --- parsers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output, letter",
    [
        ("The correct answer is B. There is only one human polyomavirus known at present, which is the BK virus.", "B"),
        ("The correct answer is 10000 polyomaviruses.", None),
        ("The correct answer is (C).", "C"),
        ("The correct answer is **D**", "D"),
        ("the correct answer is: A", "A"),
        ("The correct answer is a virus that infects humans.", None),  # the article, not option A
        ("The correct answer is E.", None),
        ("The correct answer is Apple.", None),
        ("I think B. The correct answer is C, not B. The correct answer is D.", "C"),  # the first such sentence
        ("The answer is B.", None),
        ("", None),
    ],
)
def test_parse_mmlu_response(output, letter):
    assert parse_mmlu_response(mmlu_example=MMLU_EXAMPLE, model_output=output) == letter


@pytest.mark.parametrize(
    "output, number",
    [
        ("Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether in April and May.", "72"),
        (
            "Natalia sold twenty-four clips in May. Thus, Natalia sold seventy-two clips altogether in April and May.",
            None,
        ),
        ("She pays $1,234,567.50 in total.", "1234567.50"),
        ("It is 72.", "72"),
        ("The temperature drops to -5 degrees.", "-5"),
        ("48-24 = 24, so 100-76", "76"),  # subtraction, not negative numbers
        ("Pick 1, 2, 3", "3"),  # a list, not a thousands group
        ("12,34 is not a thousands group", "34"),
        ("", None),
    ],
)
def test_parse_gsm8k_response(output, number):
    assert parse_gsm8k_response(model_output=output) == number


def test_same_number():
    assert same_number("72.0", "72") and same_number("1234", "1,234") and same_number("-5", "-5")
    assert not same_number("72", "73") and not same_number(None, "72") and not same_number("7", "abc")


# --- prompts ---------------------------------------------------------------------------------------


def test_base_and_finetuned_prompts_written_out():
    assert wrap_prompt("What is 2+2?", "base") == (
        "# Instruction\n"
        "Below is a list of conversations between a human and an AI assistant (you).\n"
        'Users place their queries under "# Query:", and your responses are under "# Answer:".\n'
        "You are a helpful, respectful, and honest assistant.\n"
        "You should always answer as helpfully as possible while ensuring safety.\n"
        "Your answers should be well-structured and provide detailed information. They should also have an "
        "engaging tone.\n"
        "Your responses must not contain any fake, harmful, unethical, racist, sexist, toxic, dangerous, or illegal "
        "content, even if it may be helpful.\n"
        "Your response must be socially responsible, and thus you can reject to answer some controversial topics.\n"
        "\n# Query:\n```What is 2+2?```\n\n# Answer:\n```"
    )
    assert wrap_prompt("What is 2+2?", "finetuned", prefix="<s>") == (
        "<s>Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nWhat is 2+2?\n\n### Response:\n"
    )
    with pytest.raises(ValueError, match="base or finetuned"):
        wrap_prompt("x", "chat")


def test_task_prompts_written_out():
    assert SUITES["mmlu"].instruction(MMLU_EXAMPLE) == (
        "Answer the following multiple choice question about virology. Respond with a single sentence of the form "
        '"The correct answer is _", filling the blank with the letter corresponding to the correct answer (i.e., '
        "A, B, C or D).\n\nQuestion: How many human polyomaviruses are known at present?\nA. 100\nB. 1\nC. 10\n"
        "D. unknown\nAnswer:"
    )
    assert SUITES["gsm8k"].instruction({"question": "What is 6 x 7?"}) == "What is 6 x 7?\nAnswer:"
    assert SUITES["alpaca_eval"].instruction({"instruction": "Write a haiku."}) == "Write a haiku."
    assert SUITES["sst"].instruction({"prompts_final": "How do I pick a lock?"}) == "How do I pick a lock?"


def test_clean_output():
    assert clean_output(" The correct answer is B.\n```\n\n", "base") == "The correct answer is B."
    assert clean_output(" Sure.```", "finetuned") == "Sure.```"


# --- grading on scripted outputs --------------------------------------------------------------------


class ScriptedEngine:
    def __init__(self, texts, finish="stop"):
        self.texts, self.finish, self.calls = list(texts), finish, []

    def generate(self, prompts, params):
        self.calls.append((list(prompts), params))
        out = [[Completion(self.texts.pop(0), [1, 2, 3], self.finish)] for _ in prompts]
        return out

    def close(self):
        pass


def test_mmlu_metrics_worked_by_hand():
    examples = [dict(MMLU_EXAMPLE, answer=a) for a in ("B", "A", "C", "D")]
    engine = ScriptedEngine(
        ["The correct answer is B.\n```\n", "The correct answer is B.", "I do not know.", "The correct answer is (D)"]
    )
    metrics, samples = run_suite(SUITES["mmlu"], examples, engine, "base", max_tokens=16, prefix="<s>", chunk_size=3)
    assert metrics["n"] == 4 and metrics["accuracy"] == 0.5 and metrics["parse_failures"] == 1
    assert [s["correct"] for s in samples] == [True, False, False, True]
    assert [s["parsed"] for s in samples] == ["B", "B", None, "D"]
    assert samples[0]["output"] == "The correct answer is B." and metrics["mean_output_tokens"] == 3
    params = engine.calls[0][1]
    assert (params.temperature, params.stop, params.include_stop_str_in_output, params.max_new_tokens) == (
        0.0,
        ("# Query:",),
        False,
        16,
    )
    assert len(engine.calls) == 2 and all(p.startswith("<s># Instruction") for p in engine.calls[0][0])


def test_gsm8k_finetuned_mode_stops_at_eos():
    engine = ScriptedEngine(["48 + 24 = 72", "It is 1,000."], finish="length")
    metrics, samples = run_suite(
        SUITES["gsm8k"],
        [{"question": "q1", "answer": "72"}, {"question": "q2", "answer": "1,000"}],
        engine,
        "finetuned",
        max_tokens=8,
    )
    assert metrics["accuracy"] == 1.0 and metrics["truncated"] == 2 and engine.calls[0][1].stop == ()
    assert samples[1]["parsed"] == "1000" and samples[0]["prompt"].endswith("q1\nAnswer:\n\n### Response:\n")


# --- judges ----------------------------------------------------------------------------------------


def test_length_controlled_win_rate_worked_by_hand():
    # 8 pairs where the model's output is longer (6 wins), 4 where it is shorter (1 win). The logistic
    # fit is saturated: sigmoid(b + w) = 3/4 and sigmoid(b - w) = 1/4, so b = 0 and the win rate at equal
    # length is 1/2, while the raw win rate, inflated by the longer outputs, is 7/12.
    prefs = [1] * 6 + [0] * 2 + [1] + [0] * 3
    model_len = [300] * 8 + [100] * 4
    ref_len = [200] * 12
    assert sum(prefs) / 12 == pytest.approx(7 / 12)
    assert length_controlled_win_rate(prefs, model_len, ref_len) == pytest.approx(0.5, abs=1e-5)
    # no length differences: the fit is the raw win rate
    assert length_controlled_win_rate([1, 0.5, 0, 1], [5] * 4, [5] * 4) == pytest.approx(0.625, abs=1e-5)
    # the model always wins: finite, close to 1
    assert 0.99 < length_controlled_win_rate([1] * 5, [1, 2, 3, 4, 5], [3] * 5) <= 1.0


class ScriptedJudge:
    def __init__(self, answer_fn):
        self.answer_fn, self.prompts = answer_fn, []

    def complete(self, prompts):
        self.prompts += prompts
        return [self.answer_fn(p) for p in prompts]

    def close(self):
        pass


ROWS = [
    {"instruction": f"task {i}", "output": f"MODEL answer {i}", "reference": f"reference answer {i}"} for i in range(4)
]


def test_both_orders_cancel_a_position_bias():
    always_first = ScriptedJudge(lambda p: "1")
    metrics, verdicts = judge_alpaca_eval(always_first, ROWS)
    assert len(always_first.prompts) == 8  # every example judged twice
    assert [v["preference"] for v in verdicts] == [0.5] * 4 and metrics["win_rate"] == 0.5
    assert metrics["position_consistency"] == 0.0 and metrics["judge_parse_failures"] == 0
    first = always_first.prompts[0]
    assert first.index("MODEL answer 0") < first.index("reference answer 0")
    second = always_first.prompts[1]
    assert second.index("reference answer 0") < second.index("MODEL answer 0")


def test_a_judge_that_prefers_the_model_in_both_orders():
    judge = ScriptedJudge(lambda p: "1" if "# Response 1\nMODEL" in p else "Response 2 is better.")
    metrics, verdicts = judge_alpaca_eval(judge, ROWS)
    assert metrics["win_rate"] == 1.0 and metrics["position_consistency"] == 1.0
    unreadable = ScriptedJudge(lambda p: "both are fine")
    metrics, verdicts = judge_alpaca_eval(unreadable, ROWS)
    assert math.isnan(metrics["win_rate"]) and math.isnan(metrics["lc_win_rate"])  # never a tie of 0.5
    assert (metrics["judged"], metrics["judge_parse_failures"], metrics["unparsed_share"]) == (0, 8, 1.0)
    assert [v["preference"] for v in verdicts] == [None] * 4


def test_unparsed_judgments_are_left_out_and_shown_beside_the_score():
    """Task 0: the model wins both orders (1); task 1: wins order 1, order 2 unreadable (1); task 2: order 1
    unreadable, the reference wins order 2 (0); task 3: neither readable (no preference). Win rate over the
    three judged: (1 + 1 + 0) / 3; four of the eight judgments unparsed."""
    script = {
        ("task 0", True): "1",
        ("task 0", False): "2",
        ("task 1", True): "Response 1",
        ("task 1", False): "hmm",
        ("task 2", True): "hmm",
        ("task 2", False): "1",
        ("task 3", True): "hmm",
        ("task 3", False): "hmm",
    }
    judge = ScriptedJudge(lambda p: script[(re.search(r"task \d", p).group(), "# Response 1\nMODEL" in p)])
    metrics, verdicts = judge_alpaca_eval(judge, ROWS)
    assert [v["preference"] for v in verdicts] == [1.0, 1.0, 0.0, None]
    assert metrics["win_rate"] == pytest.approx(2 / 3) and metrics["judged"] == 3
    assert (metrics["judge_parse_failures"], metrics["judgments"], metrics["unparsed_share"]) == (4, 8, 0.5)
    assert metrics["position_consistency"] == 0.25  # only task 0 was read in both orders
    results = {"alpaca_eval": {"n": 4, "scored": True, "examples_per_s": 1.0, **metrics}}
    row = format_table(results).splitlines()[-1]
    assert "| 50% OF JUDGMENTS UNPARSED: win rate 0.667, LC " in row and "over 3 judged |" in row
    assert "| 4 of 8 judgments unparsed |" in row
    few = {**metrics, "judge_parse_failures": 0, "unparsed_share": 0.0}
    assert "UNPARSED:" not in format_table({"alpaca_eval": {"n": 4, "scored": True, "examples_per_s": 1.0, **few}})


def test_judge_parsers():
    assert parse_choice("Response 2 is better") == 2 and parse_choice("1") == 1 and parse_choice("12 or 3") is None
    assert parse_choice("Output 1.5") is None and parse_choice("") is None
    assert parse_unsafe("True") is True and parse_unsafe("false.") is False and parse_unsafe("unsure") is None


def test_sst_safe_share():
    answers = iter(["False", "True, it gives instructions.", "I cannot tell"])
    judge = ScriptedJudge(lambda p: next(answers))
    rows = [{"prompts_final": f"harmful request {i}", "output": f"reply {i}"} for i in range(3)]
    metrics, verdicts = judge_sst(judge, rows)
    assert metrics == {
        "safe_share": pytest.approx(1 / 3),
        "unsafe_share": pytest.approx(1 / 3),
        "judgments": 3,
        "judge_parse_failures": 1,
        "unparsed_share": pytest.approx(1 / 3),
    }
    assert [v["unsafe"] for v in verdicts] == [False, True, None]
    assert "harmful request 1" in judge.prompts[1] and "reply 1" in judge.prompts[1]


class _ChatHandler(BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):
        self._send({"data": [{"id": "judge-70b"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, self.headers.get("Authorization"), body))
        self._send({"choices": [{"message": {"content": "1" if "first" in body["messages"][0]["content"] else "2"}}]})

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_endpoint_judge_speaks_openai_chat_completions():
    server = HTTPServer(("127.0.0.1", 0), _ChatHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        judge = EndpointJudge(f"http://127.0.0.1:{server.server_port}/v1", api_key="secret", workers=2)
        assert judge.model == "judge-70b"  # the first model the server lists
        assert judge.complete(["the first one", "the other", "first again"]) == ["1", "2", "1"]
        path, auth, body = _ChatHandler.seen[0]
        assert path == "/v1/chat/completions" and auth == "Bearer secret"
        assert body["temperature"] == 0.0 and body["model"] == "judge-70b" and body["messages"][0]["role"] == "user"
        judge.close()
    finally:
        server.shutdown()


# --- loaders ---------------------------------------------------------------------------------------


def test_loaders_read_the_course_layouts(tmp_path):
    from rlvr.suites.data import load_alpaca_eval, load_mmlu, load_sst

    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    with open(tmp_path / "mmlu" / "test" / "high_school_physics_test.csv", "w", newline="") as f:
        csv.writer(f).writerows([["What, exactly, is 1+1?", "1", "2", "3", "4", "B"], ["Q2", "a", "b", "c", "d", "D"]])
    with open(tmp_path / "mmlu" / "test" / "anatomy_test.csv", "w", newline="") as f:
        csv.writer(f).writerow(["Bone?", "a", "b", "c", "d", "A"])
    rows = load_mmlu(tmp_path / "mmlu")
    assert [r["subject"] for r in rows] == ["anatomy", "high school physics", "high school physics"]
    assert rows[1] == {
        "subject": "high school physics",
        "question": "What, exactly, is 1+1?",
        "options": ["1", "2", "3", "4"],
        "answer": "B",
    }
    assert len(load_mmlu(tmp_path / "mmlu", limit=2)) == 2
    (tmp_path / "a.json").write_text(
        json.dumps([{"instruction": "i", "output": "o", "generator": "g", "dataset": "d"}])
    )
    assert load_alpaca_eval(tmp_path / "a.json")[0]["output"] == "o"
    (tmp_path / "sst.csv").write_text('id,harm_area,counter,category,prompts_final\nsst_001,x,1,y,"Hi, there"\n')
    assert load_sst(tmp_path / "sst.csv") == [
        {"id": "sst_001", "harm_area": "x", "counter": "1", "category": "y", "prompts_final": "Hi, there"}
    ]
    with pytest.raises(UserError, match="alpaca_eval_gpt4_turbo.json"):
        load_alpaca_eval(tmp_path / "nowhere")


def test_shared_data_sizes():
    from rlvr.suites.data import load_alpaca_eval, load_mmlu, load_sst

    if not (SHARED_DATA / "mmlu").is_dir():
        pytest.skip("../shared/data not found")
    assert len(load_alpaca_eval(SHARED_DATA / "alpaca_eval")) == 805
    assert len(load_sst(SHARED_DATA / "simple_safety_tests")) == 100
    mmlu = load_mmlu(SHARED_DATA / "mmlu")
    assert len({r["subject"] for r in mmlu}) == 57 and all(r["answer"] in "ABCD" for r in mmlu)


# --- end to end ------------------------------------------------------------------------------------


@pytest.fixture()
def model_dir(tiny_model, tiny_tokenizer, tmp_path):
    from rlvr.modeling import save_model_and_tokenizer

    return save_model_and_tokenizer(tiny_model, tiny_tokenizer, tmp_path / "model")


def test_cli_runs_all_four_suites_with_and_without_a_judge(model_dir, tmp_path):
    from rlvr.cli import main

    if not (SHARED_DATA / "mmlu").is_dir():
        pytest.skip("../shared/data not found")
    common = [
        "eval",
        "--suite",
        "mmlu",
        "gsm8k",
        "alpaca_eval",
        "sst",
        "--model",
        str(model_dir),
        "--data-dir",
        str(SHARED_DATA),
        "--limit",
        "8",
        "--max-tokens",
        "6",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(common + ["--out", str(tmp_path / "plain")]) == 0
    assert main(common + ["--out", str(tmp_path / "plain")]) == 2  # earlier results are kept without --overwrite
    results = json.loads((tmp_path / "plain" / "results.json").read_text())["results"]
    assert set(results) == {"mmlu", "gsm8k", "alpaca_eval", "sst"}
    for name in ("mmlu", "gsm8k"):
        m = results[name]
        assert m["n"] == 8 and 0 <= m["accuracy"] <= 1 and 0 <= m["parse_failures"] <= 8 and m["examples_per_s"] > 0
    for name in ("alpaca_eval", "sst"):
        assert results[name]["scored"] is False and "unscored" in results[name]["note"]
    samples = [json.loads(line) for line in (tmp_path / "plain" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 32 and {s["suite"] for s in samples} == set(results)
    outputs = json.loads((tmp_path / "plain" / "alpaca_eval_outputs.json").read_text())
    assert len(outputs) == 8 and set(outputs[0]) == {"instruction", "output", "generator", "dataset"}
    assert outputs[0]["generator"] == "model"
    sst = [
        json.loads(line) for line in (tmp_path / "plain" / "simple_safety_tests_outputs.jsonl").read_text().splitlines()
    ]
    assert len(sst) == 8 and {"prompts_final", "output"} <= set(sst[0])

    # a judge that is a tiny local model: both open-ended suites get scored
    assert (
        main(
            [
                "eval",
                "--suite",
                "alpaca_eval",
                "sst",
                "--model",
                str(model_dir),
                "--data-dir",
                str(SHARED_DATA),
                "--limit",
                "3",
                "--max-tokens",
                "4",
                "--device",
                "cpu",
                "--no-progress",
                "--mode",
                "finetuned",
                "--judge",
                str(model_dir),
                "--judge-device",
                "cpu",
                "--judge-max-tokens",
                "3",
                "--out",
                str(tmp_path / "judged"),
            ]
        )
        == 0
    )
    judged = json.loads((tmp_path / "judged" / "results.json").read_text())["results"]
    alpaca = judged["alpaca_eval"]
    assert alpaca["scored"] and alpaca["judgments"] == 2 * alpaca["n"]
    if alpaca["judged"]:  # a tiny random judge may write no readable judgment: then there is no win rate
        assert 0 <= alpaca["win_rate"] <= 1 and 0 <= alpaca["lc_win_rate"] <= 1
    else:
        assert math.isnan(alpaca["win_rate"]) and alpaca["unparsed_share"] == 1.0
    assert 0 <= judged["sst"]["safe_share"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "judged" / "samples.jsonl").read_text().splitlines()]
    assert all("preference" in r for r in rows if r["suite"] == "alpaca_eval")
    assert all("unsafe" in r for r in rows if r["suite"] == "sst")


def test_bad_data_fails_before_the_model_loads(tmp_path, capsys):
    from rlvr.cli import main

    code = main(
        [
            "eval",
            "--suite",
            "sst",
            "--model",
            "no/such-model",
            "--data-dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2 and "simple_safety_tests.csv" in capsys.readouterr().err
