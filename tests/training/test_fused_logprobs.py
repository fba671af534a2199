"""The fused, chunked linear + log-softmax (``linear_log_probs``): a case worked by hand, float64
gradcheck, equality with full-logits references (values and gradients, float32 and bfloat16, every
chunking), the detached entropy, the no-grad path, compiled = eager, what is saved for backward, and
``get_response_log_probs`` on a tiny Olmo2 model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import rlvr.training.logprobs as logprobs_mod
from rlvr.training.fused_logprobs import _chunks, linear_log_probs
from rlvr.training.logprobs import get_response_log_probs
from rlvr.training.tokenize import tokenize_prompt_and_output


def _reference(hidden, weight, bias, labels):
    """Full float32 logits: (log-prob of each label, entropy)."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(n, h, v, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(v, (n,), generator=g)
    return hidden, weight, b, labels


def _grads(lp, upstream, params):
    return torch.autograd.grad((lp * upstream).sum(), [p for p in params if p is not None])


# --- worked by hand ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [1, 2])
def test_by_hand(chunk_tokens):
    W = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    b = [0.0, 0.5, -1.0]
    xs = [[1.0, 2.0], [0.5, -1.0]]
    ys = [2, 0]
    hidden = torch.tensor(xs, requires_grad=True)
    weight = torch.tensor(W, requires_grad=True)
    bias = torch.tensor(b, requires_grad=True)
    lp, ent = linear_log_probs(hidden, weight, bias, torch.tensor(ys), chunk_tokens, want_entropy=True)
    lp.sum().backward()

    for i, (x, y) in enumerate(zip(xs, ys)):
        z = [W[j][0] * x[0] + W[j][1] * x[1] + b[j] for j in range(3)]  # token 0: 1, 2.5, 2; token 1: .5, -.5, -1.5
        log_z = math.log(sum(math.exp(zj) for zj in z))
        p = [math.exp(zj - log_z) for zj in z]
        assert lp[i].item() == pytest.approx(z[y] - log_z, abs=1e-6)
        assert ent[i].item() == pytest.approx(-sum(pj * math.log(pj) for pj in p), abs=1e-6)
        # d lp / d x = W[y] - sum_j p_j W[j]; d lp / d b = onehot(y) - p
        want_dx = [W[y][k] - sum(p[j] * W[j][k] for j in range(3)) for k in range(2)]
        assert hidden.grad[i].tolist() == pytest.approx(want_dx, abs=1e-6)
    # the bias gradient sums the two tokens' (onehot - p)
    want_db = [0.0, 0.0, 0.0]
    for x, y in zip(xs, ys):
        z = [W[j][0] * x[0] + W[j][1] * x[1] + b[j] for j in range(3)]
        s = sum(math.exp(zj) for zj in z)
        for j in range(3):
            want_db[j] += (j == y) - math.exp(z[j]) / s
    assert bias.grad.tolist() == pytest.approx(want_db, abs=1e-6)


# --- gradcheck -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_tokens", [2, 4])
def test_gradcheck_float64(bias, chunk_tokens):
    hidden, weight, b, labels = _inputs(5, 3, 4, torch.float64, bias=bias)
    inputs = (hidden, weight) if b is None else (hidden, weight, b)

    def fn(h, w, *maybe_b):
        return linear_log_probs(h, w, maybe_b[0] if maybe_b else None, labels, chunk_tokens)[0]

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


# --- against full logits -------------------------------------------------------------------------------

N, H, V = 10, 16, 40


@pytest.mark.parametrize("chunk_tokens", [1, 3, N, N + 7])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_matches_full_logits(chunk_tokens, bias, dtype, tol):
    hidden, weight, b, labels = _inputs(N, H, V, dtype, bias=bias)
    upstream = torch.randn(N)
    lp, ent = linear_log_probs(hidden, weight, b, labels, chunk_tokens, want_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    got = _grads(lp, upstream, (hidden, weight, b))

    # the reference sees the same (rounded) inputs, in float32 throughout
    ref_inputs = [None if t is None else t.detach().float().requires_grad_() for t in (hidden, weight, b)]
    ref_lp, ref_ent = _reference(*ref_inputs, labels)
    want = _grads(ref_lp, upstream, ref_inputs)

    torch.testing.assert_close(lp, ref_lp.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=tol, atol=tol)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, rtol=tol, atol=tol)


def test_bfloat16_head_gradient_accumulates_in_float32():
    """Zero weights (p = 1/2 for both classes), every label 0, hidden 1: d/dW[0] = d/db[0] = sum(grad)/2.
    One token contributes 1.0 and 256 contribute 1/512 each: 1.5, exact in bfloat16, but a bfloat16
    running sum would stay at 1.0 (its spacing at 1 is 1/128)."""
    n = 257
    hidden = torch.ones(n, 1, dtype=torch.bfloat16)
    weight = torch.zeros(2, 1, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.full((n,), 1 / 256)
    upstream[0] = 2.0
    lp, _ = linear_log_probs(hidden, weight, bias, torch.zeros(n, dtype=torch.long), chunk_tokens=1)
    g_w, g_b = _grads(lp, upstream, (weight, bias))
    assert g_w.dtype == g_b.dtype == torch.bfloat16
    assert g_w[:, 0].tolist() == [1.5, -1.5] and g_b.tolist() == [1.5, -1.5]


def test_only_the_needed_gradients():
    """A frozen head (only hidden needs grad) and a frozen input (only the head): same values as both."""
    hidden, weight, b, labels = _inputs(N, H, V, torch.float32)
    upstream = torch.randn(N)
    full = _grads(linear_log_probs(hidden, weight, b, labels, 3)[0], upstream, (hidden, weight, b))
    (g_h,) = _grads(linear_log_probs(hidden, weight.detach(), b.detach(), labels, 3)[0], upstream, (hidden,))
    torch.testing.assert_close(g_h, full[0])
    g_w, g_b = _grads(linear_log_probs(hidden.detach(), weight, b, labels, 3)[0], upstream, (weight, b))
    torch.testing.assert_close(g_w, full[1])
    torch.testing.assert_close(g_b, full[2])


def test_entropy_is_differentiable_and_optional():
    hidden, weight, b, labels = _inputs(N, H, V, torch.float32)
    lp, ent = linear_log_probs(hidden, weight, b, labels, 4, want_entropy=True)
    assert lp.requires_grad and ent.requires_grad  # an entropy bonus differentiates it (test_entropy_bonus.py)
    torch.testing.assert_close(ent, _reference(hidden, weight, b, labels)[1].detach(), rtol=1e-5, atol=1e-5)
    assert torch.all(ent > 0) and torch.all(ent <= math.log(V) + 1e-5)
    lp2, none = linear_log_probs(hidden, weight, b, labels, 4)
    assert none.numel() == 0
    torch.testing.assert_close(lp2, lp)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_grad_path(context):
    hidden, weight, b, labels = _inputs(N, H, V, torch.float32)
    with_grad = linear_log_probs(hidden, weight, b, labels, 3, want_entropy=True)
    with context():
        lp, ent = linear_log_probs(hidden, weight, b, labels, 3, want_entropy=True)
    assert not lp.requires_grad and lp.grad_fn is None
    torch.testing.assert_close(lp, with_grad[0].detach(), rtol=0, atol=0)
    torch.testing.assert_close(ent, with_grad[1], rtol=0, atol=0)


def test_saves_no_logits_for_backward():
    """Autograd keeps hidden, weight, bias, labels and the (N,) logsumexp and entropy (for an entropy
    bonus's gradient): nothing of size N × V."""
    n, h, v = 30, 4, 50
    hidden, weight, b, labels = _inputs(n, h, v, torch.float32)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = linear_log_probs(hidden, weight, b, labels, 7, want_entropy=True)
    assert sorted(saved) == sorted([(n, h), (v, h), (v,), (n,), (n,), (n,)])
    lp.sum().backward()  # and backward still runs from those


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_kept_logits_give_the_recomputed_gradients_exactly(dtype, bias):
    """``keep_logits`` saves each chunk's logits (and only those besides the usual six) and its backward,
    which skips the recompute, gives bit-for-bit the gradients of the recomputing one."""
    n, h, v, chunk = 30, 8, 50, 7
    hidden, weight, b, labels = _inputs(n, h, v, dtype, bias=bias, seed=3)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(4))
    params = [hidden, weight, b]
    results = []
    for keep in (False, True):
        saved: list[tuple[int, ...]] = []

        def pack(t, saved=saved):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = linear_log_probs(hidden, weight, b, labels, chunk, want_entropy=True, keep_logits=keep)
        results.append((lp.detach(), ent, _grads(lp, upstream, params), saved))
    (lp0, ent0, g0, saved0), (lp1, ent1, g1, saved1) = results
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    for a, c in zip(g0, g1):
        assert torch.equal(a, c)
    logit_chunks = [(s.stop - s.start, v) for s in _chunks(n, chunk)]
    assert sorted(saved1) == sorted(saved0 + logit_chunks)


def test_chunks_never_leave_a_lone_row():
    as_pairs = lambda n, c: [(s.start, s.stop) for s in _chunks(n, c)]  # noqa: E731
    assert as_pairs(7, 3) == [(0, 3), (3, 7)]
    assert as_pairs(6, 3) == [(0, 3), (3, 6)]
    assert as_pairs(4, 1) == [(0, 1), (1, 2), (2, 4)]
    assert as_pairs(1, 5) == [(0, 1)]
    assert as_pairs(5, 9) == [(0, 5)]


# --- compiled passes -----------------------------------------------------------------------------------


def test_compiled_matches_eager():
    pytest.importorskip("torch._inductor")
    results = []
    for compiled in (False, True):
        hidden, weight, b, labels = _inputs(7, 8, 24, torch.float32)
        upstream = torch.randn(7, generator=torch.Generator().manual_seed(1))
        lp, ent = linear_log_probs(hidden, weight, b, labels, 3, want_entropy=True, compiled=compiled)
        lp_only, _ = linear_log_probs(hidden, weight, b, labels, 3, compiled=compiled)
        results.append((lp, ent, lp_only, _grads(lp, upstream, (hidden, weight, b))))
    (lp0, ent0, only0, g0), (lp1, ent1, only1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(only1, only0, rtol=1e-5, atol=1e-6)
    for a, c in zip(g1, g0):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


# --- get_response_log_probs on a tiny Olmo2 ------------------------------------------------------------


def _model_reference(model, input_ids, labels):
    logp = torch.log_softmax(model(input_ids).logits.float(), -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [4, 2048])
def test_get_response_log_probs_uses_the_fused_head(tiny_model, tiny_tokenizer, monkeypatch, chunk_tokens):
    tok = tokenize_prompt_and_output(["What is 2+3?", "Say hi"], [" It is 5.", " hi hi hi"], tiny_tokenizer)
    ids, labels = tok["input_ids"], tok["labels"]
    w = torch.randn(labels.shape)

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("the Linear-head path must not use activation checkpointing")

    monkeypatch.setattr(logprobs_mod, "checkpoint", no_checkpoint)
    out = get_response_log_probs(tiny_model, ids, labels, True, chunk_tokens=chunk_tokens)
    assert out["log_probs"].shape == out["token_entropy"].shape == labels.shape
    assert out["token_entropy"].requires_grad  # differentiable: an entropy bonus (test_entropy_bonus.py)
    out["log_probs"].mul(w).sum().backward()
    fused = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad(set_to_none=True)

    ref_lp, ref_ent = _model_reference(tiny_model, ids, labels)
    ref_lp.mul(w).sum().backward()
    torch.testing.assert_close(out["log_probs"], ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["token_entropy"], ref_ent.detach(), rtol=1e-5, atol=1e-5)
    for n, p in tiny_model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert fused["lm_head.weight"].abs().sum() > 0


def test_get_response_log_probs_fallback_still_matches(tiny_model, tiny_tokenizer):
    """A model whose config flags post-processed logits takes the model's own logits (checkpointed chunks)."""
    tok = tokenize_prompt_and_output(["What is 2+3?"], [" It is 5."], tiny_tokenizer)
    ids, labels = tok["input_ids"], tok["labels"]
    tiny_model.config.final_logit_softcapping = 30.0  # Olmo2 ignores it: its logits stay the plain head's
    assert logprobs_mod._lm_head(tiny_model) is None
    out = get_response_log_probs(tiny_model, ids, labels, True, chunk_tokens=3)
    ref_lp, ref_ent = _model_reference(tiny_model, ids, labels)
    torch.testing.assert_close(out["log_probs"], ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["token_entropy"], ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk_tokens", [3, 2048])
def test_positions_send_only_those_tokens_through_the_head(
    tiny_model, tiny_tokenizer, monkeypatch, fused, chunk_tokens
):
    """With ``positions`` (the response mask) the head sees only those tokens; their log-probs, entropies
    and gradients are the full pass's, every other position holds 0, and its label is never read."""
    tok = tokenize_prompt_and_output(["What is 2+3?", "Say hi"], [" It is 5.", " hi hi hi"], tiny_tokenizer)
    ids, labels, mask = tok["input_ids"], tok["labels"], tok["response_mask"]
    assert 0 < mask.sum() < mask.numel()
    if not fused:
        tiny_model.config.final_logit_softcapping = 30.0  # Olmo2 ignores it; rlvr takes the model's own logits
    seen = []
    real = logprobs_mod.linear_log_probs
    monkeypatch.setattr(
        logprobs_mod, "linear_log_probs", lambda h, *a, **k: seen.append(h.shape[0]) or real(h, *a, **k)
    )
    w = torch.randn(labels.shape)

    full = get_response_log_probs(tiny_model, ids, labels, True, chunk_tokens=chunk_tokens)
    (full["log_probs"] * w * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad(set_to_none=True)

    unreadable = labels.masked_fill(~mask, 10**6)  # out of the vocabulary: gathering it would raise
    seen.clear()
    out = get_response_log_probs(tiny_model, ids, unreadable, True, chunk_tokens=chunk_tokens, positions=mask)
    (out["log_probs"] * w).sum().backward()
    assert seen == ([int(mask.sum())] if fused else [])
    torch.testing.assert_close(out["log_probs"], torch.where(mask, full["log_probs"], 0.0).detach())
    torch.testing.assert_close(out["token_entropy"], torch.where(mask, full["token_entropy"], 0.0))
    for n, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_positions_of_another_shape_are_refused(tiny_model, tiny_tokenizer):
    tok = tokenize_prompt_and_output(["What is 2+3?"], [" It is 5."], tiny_tokenizer)
    with pytest.raises(ValueError, match="positions has shape"):
        get_response_log_probs(tiny_model, tok["input_ids"], tok["labels"], positions=tok["response_mask"][:, 1:])
