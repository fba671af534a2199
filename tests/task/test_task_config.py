"""Prompt, data and reward settings: chat and template-file prompts, one-line errors before any model
loads, and several named validation sets logged under their names."""

from __future__ import annotations

import copy
import json

import pytest
from test_trainer import run, tiny_config

from rlvr.commands.train import train
from rlvr.config import DataConfig, ModelConfig, PromptOptions, RewardConfig
from rlvr.errors import UserError
from rlvr.task.build import validation_metrics
from rlvr.task.prompts import PromptError, resolve_prompt
from rlvr.training.metrics_log import read_metrics

CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


# --- prompts -------------------------------------------------------------------------------------


def test_template_file_prompt(tmp_path):
    path = tmp_path / "mine.prompt"
    path.write_text("Q: {question}\nA: {{answer in braces}}")
    prompt = resolve_prompt(str(path), stop=("\n\n",))
    assert (prompt.name, prompt.stop, prompt.default_reward) == ("mine", ("\n\n",), "boxed")
    assert prompt.render("2+2?") == "Q: 2+2?\nA: {answer in braces}"
    assert resolve_prompt("r1_zero").stop == ("</answer>",) and resolve_prompt("r1_zero", stop=()).stop == ()


@pytest.mark.parametrize(
    "text, message",
    [
        ("Q: {problem}", r"has the placeholder\(s\) \{problem\}; its one placeholder is \{question\}"),
        ("Q: nothing", "has no {question} placeholder"),
        ("Q: {question", "not a valid template"),
    ],
)
def test_bad_template_files_are_named_with_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.prompt"
    path.write_text(text)
    with pytest.raises(PromptError, match=message):
        resolve_prompt(str(path))


def test_chat_prompt_renders_system_and_user_template(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    with pytest.raises(PromptError, match="has no chat template"):
        resolve_prompt("chat").bind(tok)
    tok.chat_template = CHAT_TEMPLATE
    plain = resolve_prompt("chat").bind(tok)
    assert plain.render("2+2?") == "[user] 2+2?\n[assistant] "
    styled = resolve_prompt("chat", system="Be brief.", user_template="Solve: {question}").bind(tok)
    assert styled.render("2+2?") == "[system] Be brief.\n[user] Solve: 2+2?\n[assistant] "
    with pytest.raises(PromptError, match="prompt_options.system applies to prompt chat"):
        resolve_prompt("r1_zero", system="Be brief.")


def test_chat_prompt_warns_when_the_turn_does_not_end_at_eos(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.warns(
        UserWarning, match="ends a turn with '<\\|end\\|>' but the tokenizer's EOS token is '<\\|endoftext\\|>'"
    ):
        resolve_prompt("chat").bind(tok)
    tok.chat_template = tok.chat_template.replace("<|end|>", tok.eos_token)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_prompt("chat").bind(tok)


# --- one-line errors before any model loads ------------------------------------------------------


def refuse_to_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the settings were checked")


@pytest.fixture()
def unloadable_model(tmp_path):
    """A model directory that fails to load: a run that reached the loading step says so, not the
    setting under test."""
    path = tmp_path / "unloadable"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    return ModelConfig(name_or_path=str(path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(prompt="prompts/missing.prompt"), "unknown prompt 'prompts/missing.prompt': not a built-in"),
        (
            dict(reward=RewardConfig(fn="rewards/missing.py:score")),
            "reward.fn 'rewards/missing.py:score': no such file",
        ),
        (dict(reward=RewardConfig(fn="score")), "reward.fn 'score' is not a reward function"),
        (dict(prompt="chat", model=ModelConfig(fresh="tiny")), "model.fresh trains a tokenizer without one"),
        (dict(prompt_options=PromptOptions(system="hi")), "prompt_options.system applies to prompt chat"),
    ],
)
def test_bad_settings_fail_in_validation(gsm8k_path, tmp_path, unloadable_model, overrides, message):
    with pytest.raises(UserError, match=message) as info:
        train(tiny_config(gsm8k_path, **{"model": unloadable_model, **overrides}), tmp_path / "run")
    assert "\n" not in str(info.value)


def test_unknown_column_and_missing_function_fail_before_the_model_loads(
    gsm8k_path, tmp_path, unloadable_model, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "score.py").write_text("def other(response, ground_truth, **fields):\n    return 1.0\n")
    cfg = tiny_config(
        gsm8k_path,
        model=unloadable_model,
        data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2, question_field="problem"),
    )
    with pytest.raises(
        UserError,
        match=r"train.jsonl:1: .*no column 'problem' \(columns: question, answer\); "
        "set data.question_field to one of them",
    ):
        train(cfg, tmp_path / "a")
    cfg = tiny_config(gsm8k_path, model=unloadable_model, reward=RewardConfig(fn="score.py:score"))
    with pytest.raises(UserError, match=r"score.py has no function 'score' \(functions there: other\)"):
        train(cfg, tmp_path / "b")


def test_cli_prints_one_line(gsm8k_path, tmp_path, capsys):
    from rlvr.cli import main

    rc = main(
        [
            "train",
            "--out",
            str(tmp_path / "run"),
            "--model.fresh",
            "tiny",
            "--data.train_source",
            str(gsm8k_path),
            "--reward.fn",
            "nope.py:f",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlvr train: invalid configuration: reward.fn 'nope.py:f': no such file nope.py")


# --- several validation sets ---------------------------------------------------------------------


def test_named_validation_sets_are_logged_under_their_names(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    rows = [{"q": f"What is {i} + {i}?", "a": str(2 * i), "level": i} for i in range(4)]
    (tmp_path / "doubles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(
        train_source=str(gsm8k_path),
        train_size=16,
        val_sources=(
            f"gsm8k={gsm8k_path} size=2",
            f"doubles={tmp_path / 'doubles.jsonl'} question_field=q answer_field=a answer_format=raw size=3",
        ),
    )
    cfg = tiny_config(gsm8k_path, data=data, reward=RewardConfig(fn="exact"))
    run(cfg, tmp_path / "run", tiny_model, tiny_tokenizer)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    for r in (first, last):
        assert {"val/reward", "val/gsm8k/accuracy", "val/doubles/accuracy", "val/doubles/format_reward"} <= set(r)
        assert r["val/reward"] == r["val/gsm8k/accuracy"]
    samples = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "val_step_0.jsonl").read_text().splitlines()]
    assert [s["val_set"] for s in samples] == ["gsm8k", "gsm8k", "doubles", "doubles"]  # log.val_samples=2 per set


def test_a_validation_set_may_name_its_own_reward(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    """Two sets of the same rows: ``own`` graded by the built-in ``exact``, ``run`` by the run's reward
    (the prompt question_only's own); each dumped sample's reward is its set's function of its response."""
    from rlvr.task.rewards import BUILTIN_REWARDS

    data = DataConfig(
        train_source=str(gsm8k_path),
        train_size=16,
        val_sources=(f"run={gsm8k_path} size=2", f"own={gsm8k_path} size=2 reward=exact"),
    )
    run(tiny_config(gsm8k_path, data=data), tmp_path / "run", tiny_model, tiny_tokenizer)
    samples = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "val_step_0.jsonl").read_text().splitlines()]
    graded_by = {"run": BUILTIN_REWARDS["question_only"], "own": BUILTIN_REWARDS["exact"]}
    assert [s["val_set"] for s in samples] == ["run", "run", "own", "own"]
    for s in samples:
        want = graded_by[s["val_set"]](s["response"], s["ground_truth"])
        assert (s["reward"], s["format_reward"]) == (want["reward"], want["format_reward"])
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    for name in ("run", "own"):
        mine = [s for s in samples if s["val_set"] == name]
        assert first[f"val/{name}/format_reward"] == pytest.approx(sum(s["format_reward"] for s in mine) / 2)
    # exact accepts any non-empty answer as formatted; question_only wants a \boxed{}: the two differ here
    assert first["val/own/format_reward"] != first["val/run/format_reward"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a=b reward=nope", "unknown reward 'nope'; choose one of r1_zero, question_only, boxed, exact, code"),
        ("gsm8k", "has no NAME=SOURCE"),
        ("a=b colour=red", "unknown option 'colour=red'"),
        ("a=b size=many", "size must be a whole number"),
    ],
)
def test_bad_validation_sources_are_named(gsm8k_path, tmp_path, spec, message):
    cfg = tiny_config(gsm8k_path, data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_sources=(spec,)))
    with pytest.raises(UserError, match=message):
        train(cfg, tmp_path / "run")


# --- rlvr eval reads the same settings -----------------------------------------------------------


def test_eval_refuses_bad_settings_in_one_line_before_loading(
    tmp_path, capsys, gsm8k_path, tiny_model, tiny_tokenizer, monkeypatch
):
    import rlvr.modeling
    from rlvr.cli import main

    tiny_model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(rlvr.modeling, "load_model_and_tokenizer", refuse_to_load)
    capsys.readouterr()
    base = ["eval", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--data", str(gsm8k_path)]
    for extra, message in [
        (["--reward", "nope.py:f"], "reward.fn 'nope.py:f': no such file nope.py"),
        (["--prompt", "missing.prompt"], "unknown prompt 'missing.prompt'"),
        (["--question-field", "problem"], "no column 'problem' (columns: question, answer)"),
        (
            ["--config", str(tmp_path / "c.yaml"), "--prompt", "chat"],
            "sets the prompt, data and reward; leave out --prompt",
        ),
    ]:
        (tmp_path / "c.yaml").write_text("prompt: question_only\n")
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_eval_gives_system_and_user_template_to_the_chat_prompt_among_several(tmp_path, tiny_tokenizer):
    """``rlvr eval --prompt r1_zero --prompt chat --system ...``: the system message is the chat prompt's;
    the built-in keeps its template. With no chat prompt among them, the flag is refused with the fix."""
    from rlvr.commands.evaluate import EvalConfig, eval_tasks
    from rlvr.task.build import TaskConfigError

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    common = dict(model=str(tmp_path / "model"), out=tmp_path / "out", data=str(data), system="Be brief.")

    tasks = eval_tasks(EvalConfig(prompt=("r1_zero", "chat"), user_template="Q: {question}", **common))
    builtin, chat = tasks.prompts
    assert (builtin.name, builtin.system, builtin.user_template) == ("r1_zero", None, None)
    assert chat.bind(tok).render("2+2?") == "[system] Be brief.\n[user] Q: 2+2?\n[assistant] "
    assert builtin.render("2+2?") == resolve_prompt("r1_zero").render("2+2?")

    with pytest.raises(
        TaskConfigError, match="^--system applies to --prompt chat .* not to r1_zero, question_only; add"
    ):
        eval_tasks(EvalConfig(prompt=("r1_zero", "question_only"), **common))


# --- validation with k samples per question -----------------------------------------------------


def test_validation_metrics_add_avg_and_pass_at_k_for_every_set():
    metrics = {
        "accuracy": 0.5,
        "format_rate": 1.0,
        "mean_response_length": 3.0,
        "truncated_rate": 0.0,
        "avg_at_k": 0.5,
        "pass_at_k": {"1": 0.5, "2": 0.75, "4": 1.0},
    }
    first = validation_metrics(metrics, "gsm", first=True)
    assert {k: first[k] for k in ("val/avg@4", "val/pass@1", "val/pass@2", "val/pass@4")} == {
        "val/avg@4": 0.5,
        "val/pass@1": 0.5,
        "val/pass@2": 0.75,
        "val/pass@4": 1.0,
    }
    assert first["val/gsm/avg@4"] == 0.5 and first["val/gsm/pass@4"] == 1.0
    single = validation_metrics({k: v for k, v in metrics.items() if "_at_k" not in k}, "", first=True)
    assert not [k for k in single if "@" in k]


PARITY_REWARD = """
def score(response, ground_truth, **fields):
    right = float(len(response) % 2 == 0)
    return {"reward": right, "format_reward": 1.0, "answer_reward": right}
"""


def test_training_validation_samples_k_per_question_and_logs_pass_at_k(tmp_path, monkeypatch):
    """eval_n 4 on two questions: pass@j from each question's count c of correct samples among its 4,
    1 - C(4 - c, j) / C(4, j) averaged over the questions, worked from the dumped validation samples."""
    from math import comb

    from rlvr.cli import main as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "score.py").write_text(PARITY_REWARD)
    (tmp_path / "run.yaml").write_text(
        "model: {fresh: tiny, tokenizer_vocab_size: 300}\n"
        'data: {train_source: "arith:steps=1,max_value=9", train_size: 8, val_split: validation, val_size: 2}\n'
        "reward: {fn: score.py:score}\n"
        "rollout: {n_prompts_per_rollout_batch: 2, group_size: 2, max_new_tokens: 6}\n"
        "optim: {lr: 1e-3, gradient_accumulation_steps: 1}\n"
        "log: {progress: false, val_samples: 8}\n"
        "n_steps: 1\neval_every: 0\neval_n: 4\n"
    )
    assert cli(["train", "--config", "run.yaml", "--out", "run"]) == 0
    [start] = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 0]
    dumped = [
        json.loads(line) for line in (tmp_path / "run" / "rollouts" / "val_step_0.jsonl").read_text().splitlines()
    ]
    assert len(dumped) == 8
    correct: dict[str, int] = {}
    for sample in dumped:
        correct[sample["prompt"]] = correct.get(sample["prompt"], 0) + (sample["category"] == "correct")
    assert len(correct) == 2
    for j in (1, 2, 4):
        want = sum(1 - comb(4 - c, j) / comb(4, j) for c in correct.values()) / 2
        assert start[f"val/pass@{j}"] == pytest.approx(want)
    assert start["val/avg@4"] == pytest.approx(sum(correct.values()) / 8) == pytest.approx(start["val/reward"])


# --- chat rows: a question column of messages ----------------------------------------------------

FEW_SHOT = [
    {"role": "user", "content": "1+1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+2?"},
]


def _chat_rows(tmp_path):
    path = tmp_path / "chat_rows.jsonl"
    rows = [
        {"question": FEW_SHOT, "answer": "#### 4"},
        {"question": [{"role": "system", "content": "Own."}, {"role": "user", "content": "3+3?"}], "answer": "#### 6"},
        {"question": "5+5?", "answer": "#### 10"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_rows_render_with_the_chat_template(tiny_tokenizer, tmp_path):
    from rlvr.task.data import load_examples

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    few_shot, own_system, plain = load_examples(str(_chat_rows(tmp_path)))
    assert few_shot.messages == tuple(FEW_SHOT) and few_shot.question == "2+2?" and plain.messages is None
    prompt = resolve_prompt("chat", system="Be brief.").bind(tok)
    assert (
        prompt.render_example(few_shot) == "[system] Be brief.\n[user] 1+1?\n[assistant] 2\n[user] 2+2?\n[assistant] "
    )
    assert prompt.render_example(own_system) == "[system] Own.\n[user] 3+3?\n[assistant] "  # the row's system wins
    assert prompt.render_example(plain) == prompt.render("5+5?") == "[system] Be brief.\n[user] 5+5?\n[assistant] "
    assert prompt.example_messages(own_system) == list(own_system.messages)


def test_chat_rows_in_rlvr_eval(tiny_tokenizer, tmp_path):
    from test_evaluate import ScriptedEngine

    from rlvr.commands.evaluate import evaluate
    from rlvr.engines import SamplingParams
    from rlvr.task.data import load_examples

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    examples = load_examples(str(_chat_rows(tmp_path)))
    engine = ScriptedEngine([("\\boxed{4}", "stop"), ("\\boxed{7}", "stop"), ("\\boxed{10}", "stop")])
    metrics, samples = evaluate(None, tok, examples, resolve_prompt("chat"), engine, SamplingParams(n=1))
    assert [s["prompt"] for s in samples] == [
        "[user] 1+1?\n[assistant] 2\n[user] 2+2?\n[assistant] ",
        "[system] Own.\n[user] 3+3?\n[assistant] ",
        "[user] 5+5?\n[assistant] ",
    ]
    assert metrics["accuracy"] == pytest.approx(2 / 3)


def test_chat_rows_need_the_chat_prompt_before_any_model_loads(
    tiny_model, tiny_tokenizer, tmp_path, capsys, monkeypatch
):
    from rlvr.cli import main
    from rlvr.modeling import save_model_and_tokenizer

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    save_model_and_tokenizer(tiny_model, tok, tmp_path / "model")
    capsys.readouterr()  # the save's progress bar
    monkeypatch.setattr("rlvr.modeling.load_model_and_tokenizer", refuse_to_load)
    args = [
        "eval",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(_chat_rows(tmp_path)),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "question column holds chat messages" in err and "set the prompt to chat" in err
    assert len(err.strip().splitlines()) == 1
    assert main([*args, "--prompt", "chat", "--user-template", "Q: {question}"]) == 2
    assert "prompt_options.user_template wraps one-string questions" in capsys.readouterr().err


def test_rlvr_eval_config_grades_a_set_with_its_own_reward(gsm8k_path, tmp_path):
    from rlvr.commands.evaluate import EvalConfig, eval_tasks
    from rlvr.task.build import set_rewards
    from rlvr.task.data import load_examples

    (tmp_path / "run.yaml").write_text(
        f"data: {{val_sources: ['plain={gsm8k_path} size=2', 'own={gsm8k_path} size=2 reward=exact']}}\n"
    )
    tasks = eval_tasks(EvalConfig(model="m", out=tmp_path / "out", config=tmp_path / "run.yaml"))
    assert [s.reward for s in tasks.sources] == [None, "exact"]
    examples = load_examples(str(gsm8k_path), "test", limit=2)
    own = set_rewards(tasks.configs[0], tasks.sources, [("plain", examples), ("own", examples)])
    try:
        assert list(own) == ["own"]
        # exact reads the whole response as the answer; the run's r1_zero would want <answer> tags
        assert own["own"]("72", "72")["reward"] == 1.0 and own["own"]("71", "72")["reward"] == 0.0
    finally:
        for reward in own.values():
            reward.close()


def test_grpo_samples_from_chat_rows(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    """rlvr train on chat rows: every rollout's prompt is its row's conversation through the chat template."""
    rows = [
        {"question": [*FEW_SHOT[:2], {"role": "user", "content": f"{i}+{i}?"}], "answer": f"#### {2 * i}"}
        for i in range(8)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    data = DataConfig(train_source=str(tmp_path / "train.jsonl"), train_size=8, val_size=2, val_split="train")
    run(tiny_config(gsm8k_path, data=data, prompt="chat"), tmp_path / "run", tiny_model, tok)
    dumped = [
        json.loads(line)
        for path in (tmp_path / "run" / "rollouts").glob("step_*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert dumped
    for sample in dumped:
        i = int(sample["ground_truth"]) // 2
        assert sample["prompt"] == f"[user] 1+1?\n[assistant] 2\n[user] {i}+{i}?\n[assistant] "
