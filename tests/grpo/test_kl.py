"""KL to a reference (``rlvr.grpo.kl``): the three estimators by hand and as verl writes them, and the
train step's KL term: zero against an identical reference, the loss's extra term exactly
``kl_coef`` x the aggregated estimate, packed = padded, and a LoRA policy's reference = its base model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import family_model

from rlvr.grpo import Reference, kl_penalty
from rlvr.grpo.aggregate import aggregate_loss_across_microbatch
from rlvr.training.logprobs import get_response_log_probs
from rlvr.training.lora import adapters_disabled
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update


def test_estimators_by_hand():
    # p = 0.5 and p_ref = 0.25 for the first token (log r = log(p_ref / p) = -log 2), the other way round
    # for the second (log r = +log 2).
    logp = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64))
    ln2 = math.log(2)
    # k1 = -log r
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[ln2, -ln2]], dtype=torch.float64))
    # k2 = (log r)^2 / 2
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[ln2**2 / 2] * 2], dtype=torch.float64))
    # k3 = r - 1 - log r: 0.5 - 1 + ln 2 = 0.19315, 2 - 1 - ln 2 = 0.30685
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[ln2 - 0.5, 1 - ln2]], dtype=torch.float64))
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        torch.testing.assert_close(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, name))
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros_like(logp))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_estimators_equal_verl_on_shared_inputs():
    """verl, verl/trainer/ppo/core_algos.py ``kl_penalty_forward`` (``kl_penalty`` in older releases),
    written out here:
        "kl"/"k1":          logprob - ref_logprob
        "mse"/"k2":         0.5 * (logprob - ref_logprob).square()
        "low_var_kl"/"k3":  kl = clamp(ref_logprob - logprob, -20, 20); ratio = exp(kl)
                            kld = ratio - kl - 1; clamp(kld, -10, 10)"""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 6
    ref = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 6
    ref[0, 0], logp[0, 0] = -30.0, -1.0  # log r = -29 -> -20: exp(-20) + 20 - 1 = 19 -> 10
    ref[1, 0], logp[1, 0] = -1.0, -30.0  # log r = 29 -> 20: exp(20) - 21 -> 10
    ref[2, 0], logp[2, 0] = -6.0, -1.0  # log r = -5: exp(-5) + 4 = 4.0067, inside the clamp
    kl = torch.clamp(ref - logp, -20, 20)
    verl_k3 = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), verl_k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), logp - ref)
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), 0.5 * (logp - ref).square())
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0, 0] == k3[1, 0] == 10.0 and float(k3[2, 0]) == pytest.approx(math.exp(-5) + 4)


def test_k3_gradient_vanishes_at_the_reference_and_k1_does_not():
    x = torch.zeros(1, 3, requires_grad=True)
    kl_penalty(x, torch.zeros(1, 3), "k3").sum().backward()
    assert torch.equal(x.grad, torch.zeros(1, 3))  # d/dx (exp(-x) - 1 + x) = 1 - exp(-x) = 0 at x = 0
    y = torch.zeros(1, 3, requires_grad=True)
    kl_penalty(y, torch.zeros(1, 3), "k1").sum().backward()
    assert torch.equal(y.grad, torch.ones(1, 3))


def _batch(vocab: int, rows: int = 4, width: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        mask[r, 2 : width - r % 2] = True  # responses of different lengths after a two-token prompt
    return ids, torch.roll(ids, -1, 1), mask


def _update(model, ids, labels, mask, advantages, reference=None, kl_coef=0.0, **kw):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the loss and the metadata matter
    spec = UpdateSpec(2, None, kl_coef_in_loss=kl_coef, **kw)
    loss, meta = policy_gradient_update(model, opt, StepBatch(ids, labels, mask, advantages), spec, reference=reference)
    return float(loss), meta


def test_identical_reference_gives_zero_kl_and_the_same_loss(tiny_model):
    ids, labels, mask = _batch(tiny_model.config.vocab_size)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5])
    reference = Reference(copy.deepcopy(tiny_model).requires_grad_(False))
    plain_loss, plain = _update(tiny_model, ids, labels, mask, adv)
    kl_loss, with_kl = _update(tiny_model, ids, labels, mask, adv, reference, kl_coef=0.5)
    assert with_kl["kl_ref"] == 0.0
    assert kl_loss == pytest.approx(plain_loss, abs=1e-7)
    # the zero-advantage row still has a KL gradient, so it is not skipped
    assert (plain["n_sequences"], with_kl["n_sequences"]) == (3, 4)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_is_coef_times_the_aggregated_estimate(tiny_model, estimator):
    ids, labels, mask = _batch(tiny_model.config.vocab_size)
    adv = torch.tensor([1.0, -1.0, 0.25, 0.5])
    other = copy.deepcopy(tiny_model).requires_grad_(False)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    plain_loss, _ = _update(tiny_model, ids, labels, mask, adv)
    kl_loss, meta = _update(tiny_model, ids, labels, mask, adv, Reference(other), kl_coef=0.3, kl_estimator=estimator)
    with torch.no_grad():
        logp = get_response_log_probs(tiny_model, ids, labels, positions=mask)["log_probs"]
        ref = get_response_log_probs(other, ids, labels, positions=mask)["log_probs"]
    kl = kl_penalty(logp, ref, estimator)
    # sequence aggregation: the mean over sequences of each one's mean over its response tokens
    expected = float(aggregate_loss_across_microbatch(kl, mask, "sequence"))
    assert kl_loss - plain_loss == pytest.approx(0.3 * expected, rel=1e-4, abs=1e-7)
    assert meta["kl_ref"] == pytest.approx(float(kl[mask].mean()), rel=1e-5)
    assert meta["kl_ref"] != 0.0


def test_packed_equals_padded_with_kl(tiny_tokenizer):
    from rlvr.training.tokenize import tokenize_prompt_and_output

    model = family_model("olmo2", tiny_tokenizer)
    other = family_model("olmo2", tiny_tokenizer, seed=1).requires_grad_(False)
    tok = tokenize_prompt_and_output(
        ["What is 2+2?"] * 2 + ["Name a color."] * 2, ["4", "four", "red", "blue"], tiny_tokenizer
    )
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5])
    results = []
    for packed in (False, True):
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        loss, meta = policy_gradient_update(
            trained,
            opt,
            StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], adv),
            UpdateSpec(1, None, shared_prefix=packed, kl_coef_in_loss=0.2),
            reference=Reference(other),
        )
        results.append((float(loss), meta["kl_ref"], meta["backbone_tokens"], list(trained.parameters())))
    (la, ka, ta, pa), (lb, kb, tb, pb) = results
    assert tb < ta  # the packed run did pack
    assert lb == pytest.approx(la, rel=1e-5) and kb == pytest.approx(ka, rel=1e-5) and ka > 0
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_lora_reference_is_the_base_model_with_adapters_off(tiny_model):
    from rlvr.config import LoraConfig
    from rlvr.training.lora import apply_lora

    base = copy.deepcopy(tiny_model)
    policy = apply_lora(copy.deepcopy(tiny_model), LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    with torch.no_grad():  # adapters as if trained (B starts at zero, which would change nothing)
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    ids, labels, mask = _batch(tiny_model.config.vocab_size)
    reference = Reference(policy, lambda: adapters_disabled(policy))
    with torch.no_grad():
        with reference.context():
            off = get_response_log_probs(reference.model, ids, labels, positions=mask)["log_probs"]
        on = get_response_log_probs(policy, ids, labels, positions=mask)["log_probs"]
        want = get_response_log_probs(base, ids, labels, positions=mask)["log_probs"]
    torch.testing.assert_close(off, want)
    assert not torch.allclose(on, want)  # the adapters are back on after the context
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    # through the update: the KL is that between the adapted policy and the base model
    _, meta = _update(policy, ids, labels, mask, torch.tensor([1.0, -1.0, 0.0, 0.5]), reference, kl_coef=0.1)
    assert meta["kl_ref"] == pytest.approx(float(kl_penalty(on, want)[mask].mean()), rel=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        adapters_disabled(base)
