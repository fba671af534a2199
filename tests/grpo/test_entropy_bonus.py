"""The entropy bonus (``algorithm.entropy_coef``) and DAPO's token-level loss: the fused head's entropy
gradient equals autograd through plain logits, and a whole update with the bonus (or the token-level
aggregation) equals the update of the loss written out with plain logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rlvr.training.fused_logprobs import linear_log_probs
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update


@pytest.mark.parametrize("chunk_tokens", [3, 64])
@pytest.mark.parametrize("use_log_probs", [True, False])
def test_fused_entropy_gradient_equals_autograd(chunk_tokens, use_log_probs):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=g)
    w_lp, w_ent = torch.randn(7, dtype=torch.float64, generator=g), torch.randn(7, dtype=torch.float64, generator=g)

    lp, ent = linear_log_probs(hidden, weight, bias, labels, chunk_tokens, want_entropy=True)
    loss = (w_ent * ent).sum() + ((w_lp * lp).sum() if use_log_probs else 0.0)
    fused = torch.autograd.grad(loss, (hidden, weight, bias))

    log_p = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    plain_ent = -(log_p.exp() * log_p).sum(-1)
    plain_lp = log_p.gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(ent, plain_ent)
    plain_loss = (w_ent * plain_ent).sum() + ((w_lp * plain_lp).sum() if use_log_probs else 0.0)
    for a, b in zip(fused, torch.autograd.grad(plain_loss, (hidden, weight, bias))):
        torch.testing.assert_close(a, b)


def test_entropy_bonus_update_equals_the_loss_written_out(tiny_model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tiny_model.config.vocab_size, (4, 6), generator=g)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 2:] = True
    mask[1, 5] = False
    adv = torch.tensor([1.0, 0.0, -0.5, 0.0])  # zero advantages still get the entropy's gradient
    coef = 0.3
    model = copy.deepcopy(tiny_model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    _, meta = policy_gradient_update(
        model, opt, StepBatch(ids, labels, mask, adv), UpdateSpec(2, None, entropy_coef=coef)
    )
    assert meta["n_sequences"] == 4

    manual = copy.deepcopy(tiny_model)
    log_p = F.log_softmax(manual(input_ids=ids).logits.float(), dim=-1)
    logp = log_p.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    per_token = -adv[:, None] * logp - coef * entropy
    m = mask.float()
    ((per_token * m).sum(1) / m.sum(1)).mean().backward()  # sequence aggregation
    for (name, p), q, start in zip(model.named_parameters(), manual.parameters(), tiny_model.parameters()):
        torch.testing.assert_close(start - p, q.grad, rtol=1e-4, atol=1e-6, msg=name)  # SGD at lr 1: -grad


def test_token_level_update_equals_the_loss_written_out(tiny_model):
    """DAPO's token-level loss through the microbatched update (two microbatches, a zero-advantage row
    skipped) equals one backward of sum(-A logp over response tokens) / (the batch's response tokens)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, tiny_model.config.vocab_size, (4, 6), generator=g)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 2:] = True
    mask[1, 4:] = False
    mask[3, 3:] = False
    adv = torch.tensor([1.0, 0.0, -0.5, 2.0])
    model = copy.deepcopy(tiny_model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    spec = UpdateSpec(2, None, loss_normalization="token")
    _, meta = policy_gradient_update(model, opt, StepBatch(ids, labels, mask, adv), spec)
    assert meta["n_sequences"] == 3  # the zero-advantage row skipped; its tokens still count below

    manual = copy.deepcopy(tiny_model)
    log_p = F.log_softmax(manual(input_ids=ids).logits.float(), dim=-1)
    logp = log_p.gather(-1, labels[..., None]).squeeze(-1)
    m = mask.float()
    ((-adv[:, None] * logp * m).sum() / m.sum()).backward()
    for (name, p), q, start in zip(model.named_parameters(), manual.parameters(), tiny_model.parameters()):
        torch.testing.assert_close(start - p, q.grad, rtol=1e-4, atol=1e-6, msg=name)
