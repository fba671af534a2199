"""The three estimator axes extend the same way (a registry each), and ``ppo_clip`` is the
reweighting method that used to be called ``grpo`` (the old name still selects it)."""

from __future__ import annotations

import pytest
import torch

from rlvr.checks import resolve_config, validate_config
from rlvr.config import AlgorithmConfig, TrainConfig
from rlvr.grpo import (
    AGGREGATIONS,
    DEFAULT_CLIPRANGE,
    PRESETS,
    REWEIGHTINGS,
    aggregate_loss_across_microbatch,
    compute_policy_gradient_loss,
    register_aggregation,
)
from rlvr.training.tokenize import tokenize_prompt_and_output
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update


def test_ppo_clip_alias_is_the_same_method():
    assert REWEIGHTINGS["grpo"] is REWEIGHTINGS["ppo_clip"]
    assert DEFAULT_CLIPRANGE["grpo"] == DEFAULT_CLIPRANGE["ppo_clip"] == 0.2
    assert "grpo" in PRESETS  # the preset keeps its name
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    A = torch.tensor([1.0, -0.5, 2.0])
    new, new_meta = compute_policy_gradient_loss(A, logp, "ppo_clip", old_log_probs=old, cliprange=0.2)
    aliased, aliased_meta = compute_policy_gradient_loss(A, logp, "grpo", old_log_probs=old, cliprange=0.2)
    assert torch.equal(new, aliased)
    assert float(new_meta["clip_fraction"]) == float(aliased_meta["clip_fraction"])


def test_both_names_resolve_to_the_same_config():
    by_name = {m: resolve_config(TrainConfig(algorithm=AlgorithmConfig(reweighting=m))) for m in ("grpo", "ppo_clip")}
    for cfg in by_name.values():
        validate_config(cfg)
    assert by_name["grpo"].algorithm.cliprange == by_name["ppo_clip"].algorithm.cliprange == 0.2


@pytest.fixture()
def sequence_sum():
    """A registered aggregation: each sequence's summed token loss, averaged over sequences."""

    @register_aggregation("test_sequence_sum", per_sequence=True)
    def _batch_size(n_tokens, batch_size, normalization_constant):
        return batch_size

    yield "test_sequence_sum"
    AGGREGATIONS.pop("test_sequence_sum")


def test_registered_aggregation_is_selectable(sequence_sum):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert aggregate_loss_across_microbatch(loss, mask, sequence_sum).item() == pytest.approx((3.0 + 4.0) / 2)
    cfg = resolve_config(TrainConfig(algorithm=AlgorithmConfig(loss_normalization=sequence_sum)))
    validate_config(cfg)
    assert cfg.algorithm.normalization_constant is None


def test_unknown_aggregation_names_the_registry():
    loss, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="register_aggregation"):
        aggregate_loss_across_microbatch(loss, mask, "no_such_normalization")


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.recorded = []

    def step(self, closure=None):
        self.recorded = [p.grad.clone() for g in self.param_groups for p in g["params"]]


def test_registered_aggregation_accumulates_exactly(sequence_sum, tiny_model, tiny_tokenizer):
    """Microbatches of a registered per-sequence aggregation add up to the whole batch's gradient."""
    prompts = ["two plus two", "three plus one", "one plus one", "five minus one"]
    responses = [" four", " it is four for sure", " 2", " four four"]
    tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = []
    for accumulation in (1, 4):
        opt = _RecordingSGD(tiny_model.parameters())
        policy_gradient_update(
            tiny_model,
            opt,
            StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], advantages),
            UpdateSpec(accumulation, None, loss_normalization=sequence_sum),
        )
        grads.append(opt.recorded)
    # float32 sums in another order differ by rounding (seen: 1.5e-7 on one entry of 12,800); a wrong
    # constant would be off by a share of the gradient itself
    for whole, accumulated in zip(*grads):
        torch.testing.assert_close(accumulated, whole, rtol=1e-5, atol=1e-6)
