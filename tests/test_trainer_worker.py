"""The trainer with the hf-worker engine (its own process, weights over gloo) end to end on CPU:
weights sync before every rollout (the probe check passes), metrics match the in-process engine's."""

from __future__ import annotations

import math

from rlvr.config import AlgorithmConfig, DataConfig, EngineConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
from rlvr.logging_utils import read_metrics
from rlvr.trainer import read_summary, train


def parity_reward(response: str, ground_truth: str) -> dict:
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": float(" " in response)}


def test_worker_engine_end_to_end_with_gloo(gsm8k_path, tiny_tokenizer, tmp_path):
    from rlvr.modeling import build_model, small_olmo2_config

    def fresh():
        return build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)

    rows = {}
    for name in ("hf-worker", "hf"):
        cfg = TrainConfig(
            data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2), prompt="question_only",
            rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
            optim=OptimConfig(lr=3e-3, train_batch_size=4, gradient_accumulation_steps=1),
            algorithm=AlgorithmConfig(preset="dr_grpo", reweighting="grpo"),
            engine=EngineConfig(name=name, device="cpu", max_batch_size=64),
            log=LogConfig(progress=False, val_samples=0), n_steps=3, eval_every=0, dump_every=0,
        )
        out = tmp_path / name
        train(cfg, out, model=fresh(), tokenizer=tiny_tokenizer, reward_fn=parity_reward)
        assert read_summary(out)["status"] == "finished"
        rows[name] = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]

    worker = rows["hf-worker"]
    assert [r["step"] for r in worker] == [1, 2, 3]
    for r in worker:
        # Every sync ended with the worker's probe log-probs matching the trainer's (float32 both sides).
        assert r["sync/probe_max_abs_diff"] < 1e-3
        assert math.isfinite(r["train/loss"]) and 0 <= r["train/clip_fraction"] <= 1
    # Same seeds and weights in another process: the same rollouts and hence the same rewards per step;
    # a stale worker would diverge from step 2 on.
    assert [r["train/reward"] for r in worker] == [r["train/reward"] for r in rows["hf"]]
    assert [r["train/response_length"] for r in worker] == [r["train/response_length"] for r in rows["hf"]]
