"""One rollout path: ``SyncRollouts`` (in-process and server engines) and ``AsyncRollouts`` (worker
engines) are both ``Rollouts`` and hand over the same ``RolloutBatch`` from ``next_batch(step, model)``."""

from __future__ import annotations

import pytest
import torch

from rlvr.checks import resolve_config
from rlvr.engines import WorkerEngine, make_engine
from rlvr.engines.async_rollout import AsyncRollouts
from rlvr.engines.base import Completion, SamplingParams
from rlvr.engines.hf import HFEngine
from rlvr.engines.rollouts import RolloutBatch, Rollouts, SyncRollouts
from rlvr.errors import EngineError
from rlvr.training.tokenize import tokenize_prompt_and_output

PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "How many"]


def request(step: int):
    return PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=100 + step)


@pytest.fixture()
def model(tiny_tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    return build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=5)


def _check_batch(batch, step: int, tokenizer):
    assert isinstance(batch, RolloutBatch)
    assert batch.step == step and batch.weight_version == step - 1 and batch.prompts == PROMPTS
    assert [len(g) for g in batch.completions] == [2, 2]
    mine = tokenize_prompt_and_output([p for p in PROMPTS for _ in range(2)], batch.responses, tokenizer)
    assert torch.equal(mine["input_ids"], batch.input_ids) and torch.equal(mine["response_mask"], batch.response_mask)
    metrics = batch.metrics(current_version=step - 1)
    assert metrics["rollout/staleness"] == 0 and metrics["time/generate"] >= 0 and "time/sync" in metrics


def test_sync_rollouts_hand_over_a_rollout_batch(model, tiny_tokenizer):
    engine = make_engine("hf", model, tiny_tokenizer, max_batch_size=8)
    assert not isinstance(engine, WorkerEngine)
    rollouts = SyncRollouts(engine, tiny_tokenizer, request)
    assert isinstance(rollouts, Rollouts)
    batch = rollouts.next_batch(3, model)
    _check_batch(batch, 3, tiny_tokenizer)
    assert batch.old_log_probs is None  # the trainer's own weights sampled it: it computes them if needed
    assert rollouts.engine_for_eval(model, 3) is engine
    # the same seed and weights give the same batch
    again = rollouts.next_batch(3, model)
    assert [c.token_ids for c in again.flat_completions] == [c.token_ids for c in batch.flat_completions]


def test_async_rollouts_hand_over_the_same_batch_type(model, tiny_tokenizer):
    engine = make_engine("hf-worker", model, tiny_tokenizer, device="cpu", max_batch_size=8)
    try:
        assert isinstance(engine, WorkerEngine)
        with AsyncRollouts(engine, max_staleness=0, request=request, last_step=2) as rollouts:
            assert isinstance(rollouts, Rollouts)
            batch = rollouts.next_batch(1, model)
            _check_batch(batch, 1, tiny_tokenizer)
            assert batch.old_log_probs is not None and batch.old_log_probs.shape == batch.labels.shape
            assert batch.timings["time/rollout_wait"] >= 0
    finally:
        engine.close()


class _ShortEngine:
    """Answers one completion fewer than asked for the last prompt."""

    def generate(self, prompts, params):
        return [
            [Completion(text=" x", token_ids=[5], finish_reason="stop")] * (params.n - (i == len(prompts) - 1))
            for i in range(len(prompts))
        ]

    def sync_weights(self, model):
        return {}

    def close(self):
        pass


def test_sync_rollouts_refuse_a_batch_of_the_wrong_shape(model, tiny_tokenizer):
    with pytest.raises(
        EngineError, match=r"the engine returned \[2, 1\] completions for 2 prompts x 2 samples at step 1"
    ):
        SyncRollouts(_ShortEngine(), tiny_tokenizer, request).next_batch(1, model)


closed: list[str] = []  # what the trainer closed, in order


class ClosingHFEngine(HFEngine):
    """The hf engine, registered under its own name: it notes when the trainer closes it."""

    def close(self) -> None:
        closed.append("engine")
        super().close()


def test_trainer_closes_what_it_started_on_every_exit(gsm8k_path, model, tiny_tokenizer, tmp_path, monkeypatch):
    """A fault mid-run closes the engine the trainer built, its rollouts and its logger."""
    from rlvr.commands import train as train_command
    from rlvr.config import DataConfig, EngineConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
    from rlvr.engines import ENGINES, register_engine
    from rlvr.training.metrics_log import MetricsLogger

    closed.clear()
    real_logger_close = MetricsLogger.close
    monkeypatch.setitem(ENGINES, "hf-closing", ENGINES["hf"])  # the table entry is restored afterwards
    register_engine("hf-closing", f"{__name__}:ClosingHFEngine")
    monkeypatch.setattr(SyncRollouts, "close", lambda self: closed.append("rollouts"))
    monkeypatch.setattr(MetricsLogger, "close", lambda self: closed.append("logger") or real_logger_close(self))

    def failing_grader(response, ground_truth):
        raise RuntimeError("grader bug")

    cfg = TrainConfig(
        data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=0),
        prompt="question_only",
        rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=2, max_new_tokens=4),
        optim=OptimConfig(gradient_accumulation_steps=1),
        engine=EngineConfig(name="hf-closing"),
        log=LogConfig(progress=False),
        n_steps=1,
    )
    with pytest.raises(train_command.GraderError, match="grader bug"):
        train_command.train(cfg, tmp_path / "run", model=model, tokenizer=tiny_tokenizer, reward_fn=failing_grader)
    assert closed == ["logger", "rollouts", "engine"]  # the logger first, the engine last
    assert train_command.read_summary(tmp_path / "run")["status"] == "failed"


def test_update_spec_is_read_from_the_config_once():
    from rlvr.commands.train import MinibatchSpec, UpdateSpec
    from rlvr.config import AlgorithmConfig, OptimConfig, TrainConfig

    on_policy = MinibatchSpec.from_config(resolve_config(TrainConfig()))
    assert not on_policy.shuffle and not on_policy.uses_old_log_probs and on_policy.epochs == 1
    cfg = resolve_config(
        TrainConfig(
            algorithm=AlgorithmConfig(preset="dr_grpo", reweighting="ppo_clip"),
            optim=OptimConfig(train_batch_size=64, epochs_per_rollout_batch=2),
        )
    )
    minibatches, spec = MinibatchSpec.from_config(cfg), UpdateSpec.from_config(cfg)
    assert minibatches.shuffle and minibatches.uses_old_log_probs
    assert (minibatches.train_batch_size, minibatches.epochs) == (64, 2)
    assert (spec.reweighting, spec.cliprange, spec.loss_normalization) == ("ppo_clip", (0.2, 0.2), "constant")
    assert (spec.kl_coef_in_loss, spec.entropy_coef) == (0.0, 0.0)
    knobs = TrainConfig(
        algorithm=AlgorithmConfig(reweighting="ppo_clip", cliprange_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    )
    knob_spec = UpdateSpec.from_config(resolve_config(knobs))
    assert (knob_spec.cliprange, knob_spec.kl_coef_in_loss, knob_spec.kl_estimator, knob_spec.entropy_coef) == (
        (0.2, 0.28),
        0.1,
        "k3",
        0.01,
    )
    reward_kl = resolve_config(TrainConfig(algorithm=AlgorithmConfig(kl_coef=0.1, kl_in="reward")))
    assert UpdateSpec.from_config(reward_kl).kl_coef_in_loss == 0.0  # the KL went into the reward
    assert spec.normalization_constant == cfg.algorithm.normalization_constant
