"""CPU runs of the standard RLVR knobs through ``rlvr train`` on a tiny random OLMo-2: with each knob
on, a run trains (the weights move, the knob's metric is logged) and a run that crashes in its last
step resumes to exactly the uninterrupted result (metrics and weights)."""

from __future__ import annotations

import pytest
import torch

from rlvr.checkpoint import latest_checkpoint
from rlvr.config import AlgorithmConfig, DataConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
from rlvr.errors import GraderError
from rlvr.logging_utils import read_metrics
from rlvr.trainer import train


def parity_reward(response: str, ground_truth: str) -> dict:
    """Right about half the time on random text, so groups have signal."""
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": 1.0}


def fresh_model(tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    return build_model(small_olmo2_config(tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)


def knob_config(gsm8k_path, **sections) -> TrainConfig:
    base = {
        "data": DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=0),
        "rollout": RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
        "optim": OptimConfig(lr=3e-3, train_batch_size=4, gradient_accumulation_steps=2),
        "log": LogConfig(progress=False, val_samples=0),
    }
    base.update(sections)
    return TrainConfig(prompt="question_only", n_steps=3, eval_every=0, dump_every=0, save_every=2, **base)


def _strip_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "mem/"))} for r in rows]


def trains_and_resumes_exactly(cfg: TrainConfig, tokenizer, tmp_path, reward=parity_reward) -> list[dict]:
    """Run ``cfg`` straight, and again with a grader crash in its last step then ``--resume``; assert
    the same metrics and weights, and that training moved the weights. Returns the straight metrics."""
    straight_model = fresh_model(tokenizer)
    start = [p.detach().clone() for p in straight_model.parameters()]
    train(cfg, tmp_path / "straight", model=straight_model, tokenizer=tokenizer, reward_fn=reward)
    calls = {"n": 0}
    per_step = cfg.rollout_batch_size

    def crashes_in_the_last_step(response, gt):
        calls["n"] += 1
        if calls["n"] > per_step * (cfg.n_steps - 1) and not calls.get("resumed"):
            raise ValueError("grader bug")
        return reward(response, gt)

    broken = tmp_path / "broken"
    with pytest.raises(GraderError):
        train(cfg, broken, model=fresh_model(tokenizer), tokenizer=tokenizer, reward_fn=crashes_in_the_last_step)
    assert latest_checkpoint(broken).name == "step_000002"
    calls["resumed"] = True
    resumed_model = fresh_model(tokenizer)  # the initial weights: the checkpoint's come on top
    train(cfg, broken, resume=True, model=resumed_model, tokenizer=tokenizer, reward_fn=crashes_in_the_last_step)
    a, b = read_metrics(tmp_path / "straight" / "metrics.jsonl"), read_metrics(broken / "metrics.jsonl")
    assert _strip_timings(a) == _strip_timings(b)
    for pa, pb in zip(straight_model.parameters(), resumed_model.parameters()):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(p, s) for p, s in zip(straight_model.parameters(), start)), "training moved nothing"
    return [r for r in a if r["step"] > 0]


@pytest.mark.slow
def test_clip_higher_and_rloo_train_and_resume(gsm8k_path, tiny_tokenizer, tmp_path):
    algorithm = AlgorithmConfig(preset="rloo", reweighting="ppo_clip", cliprange_low=0.2, cliprange_high=0.28)
    rows = trains_and_resumes_exactly(knob_config(gsm8k_path, algorithm=algorithm), tiny_tokenizer, tmp_path)
    assert all(0 <= r["train/clip_fraction"] <= 1 for r in rows)
