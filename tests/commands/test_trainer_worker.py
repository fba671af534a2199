"""The trainer with the hf-worker engine (its own process, weights over gloo) end to end on CPU:
weights sync before every rollout (the probe check passes), metrics match the in-process engine's;
one-step-async runs sample batch t with the weights of step t-2 and train against those weights'
log-probs, log their staleness, resume with one on-policy batch, and never validate on weights that
failed the probe check."""

from __future__ import annotations

import math

import pytest

import rlvr.commands.train as trainer_mod
from rlvr.commands.train import read_summary, train
from rlvr.config import AlgorithmConfig, DataConfig, EngineConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
from rlvr.engines.async_rollout import AsyncRollouts
from rlvr.training.logprobs import compute_log_probs_batched
from rlvr.training.metrics_log import read_metrics
from rlvr.training.scaffold import TrainCallback


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
            data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2),
            prompt="question_only",
            rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
            optim=OptimConfig(lr=3e-3, train_batch_size=4, gradient_accumulation_steps=1),
            algorithm=AlgorithmConfig(preset="dr_grpo", reweighting="grpo"),
            engine=EngineConfig(name=name, device="cpu", max_batch_size=64),
            log=LogConfig(progress=False, val_samples=0),
            n_steps=3,
            eval_every=0,
            dump_every=0,
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


def async_config(gsm8k_path, n_steps: int, **overrides) -> TrainConfig:
    # On-policy batch sizes (one optimizer step per rollout batch): any ratio != 1 is the staleness.
    return TrainConfig(
        data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2),
        prompt="question_only",
        rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=8),
        optim=OptimConfig(lr=3e-2, gradient_accumulation_steps=1),
        algorithm=AlgorithmConfig(preset="grpo", reweighting="grpo", cliprange=0.2),
        engine=EngineConfig(name="hf-worker", device="cpu", max_batch_size=64, max_staleness=1),
        log=LogConfig(progress=False, val_samples=0),
        n_steps=n_steps,
        eval_every=2,
        dump_every=0,
        **overrides,
    )


def test_one_step_async_run_trains_on_the_sampling_weights_log_probs(gsm8k_path, tiny_tokenizer, tmp_path, monkeypatch):
    from rlvr.modeling import build_model, small_olmo2_config

    model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)
    versions = []  # versions[v]: the weights after v optimizer steps (what the trainer holds in step v+1)
    updates = []  # what each optimizer step trained on
    real_update = trainer_mod.policy_gradient_update

    class WeightsBeforeEachStep(TrainCallback):
        def on_step_begin(self, step, run_dir):
            versions.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def spy_update(model_, optimizer, batch, *args, **kwargs):
        updates.append(
            (batch.input_ids.clone(), batch.labels.clone(), batch.response_mask.clone(), batch.old_log_probs.clone())
        )
        return real_update(model_, optimizer, batch, *args, **kwargs)

    submitted = []
    real_submit = AsyncRollouts.submit
    monkeypatch.setattr(trainer_mod, "policy_gradient_update", spy_update)
    monkeypatch.setattr(
        AsyncRollouts, "submit", lambda self, step, *a: submitted.append(step) or real_submit(self, step, *a)
    )
    out = tmp_path / "async"
    train(
        async_config(gsm8k_path, n_steps=4),
        out,
        model=model,
        tokenizer=tiny_tokenizer,
        reward_fn=parity_reward,
        callbacks=[WeightsBeforeEachStep()],
    )
    assert read_summary(out)["status"] == "finished"
    assert submitted == [1, 2, 3, 4]  # nothing generated for a step 5 that never comes
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "val/reward" in rows[0] and "val/reward" in rows[4]
    steps = rows[1:]
    # Batch t is sampled by version max(t-2, 0) while the trainer holds version t-1.
    assert [r["rollout/weight_version"] for r in steps] == [0, 0, 1, 2]
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 1, 1]
    for r in steps:
        assert r["sync/probe_max_abs_diff"] < 1e-3 and r["train/n_updates"] == 1
        assert math.isfinite(r["train/loss"]) and 0 <= r["train/clip_fraction"] <= 1
        for key in (
            "time/rollout_wait",
            "time/generate",
            "time/old_logprobs",
            "time/queue",
            "time/sync",
            "tokens_per_s",
        ):
            assert r[key] >= 0, key

    model.eval()
    assert len(versions) == len(updates) == 4
    for step, (input_ids, labels, mask, old) in enumerate(updates, start=1):
        sampler = max(step - 2, 0)
        model.load_state_dict(versions[sampler])
        under_sampler = compute_log_probs_batched(model, input_ids, labels, 8)
        # The old log-probs are the sampling weights' (computed on the worker), row for row.
        assert float((old - under_sampler).abs()[mask].max()) <= 1e-4
        if step >= 2:  # one step stale: the trainer's weights give other log-probs, so the ratio is not 1
            model.load_state_dict(versions[step - 1])
            current = compute_log_probs_batched(model, input_ids, labels, 8)
            assert float((old - current).abs()[mask].max()) > 1e-2
    # Step 1 is on-policy (ratio 1 up to float noise): nothing clips. Staleness makes later steps clip.
    assert steps[0]["train/clip_fraction"] == 0
    assert any(r["train/clip_fraction"] > 0 for r in steps[1:])


def test_one_step_async_resume_samples_one_batch_on_policy(gsm8k_path, tiny_tokenizer, tmp_path):
    from rlvr.modeling import build_model, small_olmo2_config

    def fresh():
        return build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)

    out = tmp_path / "resumed"
    cfg = async_config(gsm8k_path, n_steps=2, eval_at_start=False)
    train(cfg, out, model=fresh(), tokenizer=tiny_tokenizer, reward_fn=parity_reward)
    train(
        async_config(gsm8k_path, n_steps=4, eval_at_start=False),
        out,
        resume=True,
        model=fresh(),
        tokenizer=tiny_tokenizer,
        reward_fn=parity_reward,
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and read_summary(out)["status"] == "finished"
    # The weights of step 1 were not saved: batch 3 comes from the checkpoint (version 2), on-policy.
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 2, 2]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 0, 1]
    assert rows[2]["train/clip_fraction"] == 0


def test_async_validation_never_runs_on_weights_that_failed_the_probe(gsm8k_path, tiny_tokenizer, tmp_path):
    from rlvr.commands.train import EngineError
    from rlvr.engines import make_engine
    from rlvr.modeling import build_model, small_olmo2_config

    model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)
    with make_engine("hf-worker", model, tiny_tokenizer, device="cpu", max_batch_size=64) as engine:
        engine.plant_mismatch()  # the load before the first validation corrupts the output head
        with pytest.raises(EngineError, match="validation failed at step 0.*do not match"):
            train(
                async_config(gsm8k_path, n_steps=1),
                tmp_path / "run",
                model=model,
                tokenizer=tiny_tokenizer,
                reward_fn=parity_reward,
                engine=engine,
            )
    assert read_summary(tmp_path / "run")["status"] == "failed"
