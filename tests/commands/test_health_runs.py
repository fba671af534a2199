"""The health signals, best and latest in real tiny CPU runs: a run pushed to collapse by a far too
high learning rate warns (in one line each, in metrics.jsonl and in summary.json) and a healthy one
does not; checkpoints/best holds the model of the best validation, loadable by transformers, and
checkpoints/latest is a path to the newest checkpoint."""

from __future__ import annotations

import dataclasses
import json

from rlvr.commands import evaluate
from rlvr.commands.evaluate import EvalConfig, resolve_run_model
from rlvr.commands.train import read_summary, train
from rlvr.config import DataConfig, HealthConfig, LogConfig, OptimConfig, RewardConfig, RolloutConfig, TrainConfig
from rlvr.training.checkpoint import best_model, latest_checkpoint
from rlvr.training.metrics_log import read_metrics


def parity_reward(response: str, ground_truth: str) -> dict:
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": r}


def config(lr: float, n_steps: int = 6) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(train_source="arith:steps=1,max_value=10", train_size=32, val_size=8),
        rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=8),
        optim=OptimConfig(lr=lr, gradient_accumulation_steps=1, warmup_steps=0),
        log=LogConfig(progress=False, val_samples=0),
        prompt="question_only",
        n_steps=n_steps,
        eval_every=2,
        dump_every=0,
        save_every=2,
        keep_checkpoints=2,
    )


def run(cfg, out, model, tokenizer):
    return train(cfg, out, model=model, tokenizer=tokenizer, reward_fn=parity_reward)


PARITY = """
def parity(response, ground_truth, **fields):
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": r}
"""


def with_parity_validation(cfg: TrainConfig, tmp_path) -> TrainConfig:
    """Validation graded by the same parity reward, so its reward moves with the policy."""
    path = tmp_path / "parity_reward.py"
    path.write_text(PARITY)
    return dataclasses.replace(cfg, reward=RewardConfig(fn=f"{path}:parity"))


def test_a_run_pushed_to_collapse_warns_in_one_line_in_the_metrics_and_the_summary(
    tmp_path, tiny_model, tiny_tokenizer, capsys
) -> None:
    cfg = config(lr=0.3, n_steps=20)  # a far too high learning rate: the policy turns deterministic
    run(cfg, tmp_path / "run", tiny_model, tiny_tokenizer)
    records = [h for row in read_metrics(tmp_path / "run" / "metrics.jsonl") for h in row.get("health", [])]
    signals = {h["signal"] for h in records}
    assert signals & {"no_signal", "entropy", "grad_spike"}, records
    err = capsys.readouterr().err
    for h in records:
        assert f"rlvr: health warning at step {h['step']} [{h['signal']}]: {h['message']}" in err
    summary = read_summary(tmp_path / "run")
    assert summary["health"] == {s: sum(h["signal"] == s for h in records) for s in signals}


def test_a_healthy_run_warns_of_nothing(tmp_path, tiny_model, tiny_tokenizer, capsys) -> None:
    # A random model never writes EOS, so every response hits the cap: that signal has its own test.
    cfg = dataclasses.replace(config(lr=1e-3), health=HealthConfig(truncated_max=1.0))
    run(cfg, tmp_path / "run", tiny_model, tiny_tokenizer)
    assert not any("health" in row for row in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert "health warning" not in capsys.readouterr().err
    assert read_summary(tmp_path / "run")["health"] == {}


def test_responses_at_the_cap_warn_once(tmp_path, tiny_model, tiny_tokenizer, capsys) -> None:
    run(config(lr=1e-3, n_steps=3), tmp_path / "run", tiny_model, tiny_tokenizer)
    records = [h for row in read_metrics(tmp_path / "run" / "metrics.jsonl") for h in row.get("health", [])]
    assert [(h["step"], h["signal"]) for h in records] == [(1, "length_cap")]
    assert "rollout.max_new_tokens" in records[0]["message"]


def test_best_is_the_best_validation_and_latest_a_path(tmp_path, tiny_model, tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    cfg = with_parity_validation(config(lr=0.05, n_steps=8), tmp_path)
    out = tmp_path / "run"
    run(cfg, out, tiny_model, tiny_tokenizer)
    vals = [(r["step"], r["val/reward"]) for r in read_metrics(out / "metrics.jsonl") if "val/reward" in r]
    best_value = max(v for _, v in vals)
    best_step = max(s for s, v in vals if v == best_value)  # ties go to the later step
    path, record = best_model(out)
    assert path == out / "checkpoints" / "best" / "model"
    assert (record["step"], record["val/reward"]) == (best_step, best_value)
    summary = read_summary(out)
    assert summary["best"] == {"step": best_step, "val/reward": best_value, "model": "checkpoints/best/model"}
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.config.num_hidden_layers == tiny_model.config.num_hidden_layers
    latest = out / "checkpoints" / "latest"
    assert latest.is_symlink() and latest.resolve() == latest_checkpoint(out).resolve()
    assert latest.resolve().name == "step_000008" and (latest / "model" / "config.json").is_file()
    assert summary["latest"] == "checkpoints/latest"
    # Two rolling checkpoints are kept; best is kept apart from them.
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["best", "latest", "step_000006", "step_000008"]

    # rlvr eval --model RUN_DIR evaluates the best model; --checkpoint latest the newest checkpoint.
    said: list[str] = []
    for which, expected in (("best", path), ("latest", out / "checkpoints" / "step_000008" / "model")):
        ecfg = EvalConfig(model=str(out), out=tmp_path / f"eval_{which}", data="arith:steps=1,max_value=10")
        ecfg = resolve_run_model(dataclasses.replace(ecfg, checkpoint=which), echo=said.append)
        assert ecfg.model == str(expected)
    assert said[0] == f"rlvr eval: {out} is a training run; evaluating its best model (step {best_step}, " + (
        f"val/reward {best_value:.3f}): {path}"
    )
    results = evaluate.run(
        EvalConfig(
            model=str(out),
            out=tmp_path / "eval",
            data="arith:steps=1,max_value=10",
            split="validation",
            limit=4,
            max_tokens=8,
            device="cpu",
            prompt=("question_only",),
        )
    )
    assert results


def test_best_follows_a_resumed_run_as_an_uninterrupted_one(tmp_path, tiny_tokenizer) -> None:
    from rlvr.modeling import build_model, small_olmo2_config

    def fresh():
        return build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)

    cfg = with_parity_validation(config(lr=0.05, n_steps=8), tmp_path)
    run(cfg, tmp_path / "whole", fresh(), tiny_tokenizer)
    run(dataclasses.replace(cfg, n_steps=4), tmp_path / "parts", fresh(), tiny_tokenizer)
    train(cfg, tmp_path / "parts", resume=True, reward_fn=parity_reward)
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    parts = read_metrics(tmp_path / "parts" / "metrics.jsonl")
    assert [r.get("health") for r in whole] == [r.get("health") for r in parts]
    assert best_model(tmp_path / "whole")[1] == best_model(tmp_path / "parts")[1]
    assert (
        json.loads((tmp_path / "parts" / "summary.json").read_text())["best"]
        == read_summary(tmp_path / "whole")["best"]
    )
