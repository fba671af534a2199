"""Fused, chunked ``linear + log-softmax``: per-token log-probs (and the entropy) straight from the last
hidden states, without a float32 [tokens, vocab] logits tensor kept for backward.

``linear_log_probs`` is one ``torch.autograd.Function``. Forward projects ``chunk_tokens`` hidden
states at a time (the matmul in the model's dtype: bf16 stays bf16), reduces the chunk in float32 to
(log-prob of the label, logsumexp, entropy) and drops its logits; only the hidden states, the head's
parameters, the labels and the float32 logsumexp and entropy per token are saved. Backward
recomputes each chunk's logits once and forms the softmax gradient from the saved logsumexp, then does the two
matmuls (into the hidden states, into the head's weight and bias). With ``keep_logits`` the forward's
logits (in the model's dtype) are kept for the backward instead: the same values (the same matmul on
the same inputs), one matmul fewer per chunk, for tokens x vocabulary x 2 bytes in bf16.

Memory: at OLMo-2-1B's vocabulary (100,352) one chunk of 2,048 tokens is 0.8 GB in float32, against
13 GB for a 32-sequence × 1024-token microbatch. Time: one forward matmul, one recompute and two
backward matmuls per chunk, and no activation-checkpointing machinery (no second pass of autograd
bookkeeping, no saved-tensor hooks). With ``compiled=True`` the float32 elementwise passes (logits to
log-prob/logsumexp/entropy; logits to the logits' gradient) are ``torch.compile``d so each fuses into
one or two kernels; the matmuls stay outside the compiled functions. Where the device multiplies
bf16 matrices into a float32 result (CUDA), the weight gradient accumulates over chunks inside that
matmul; elsewhere each chunk's low-precision product is added to the float32 sum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 2048


# --- float32 elementwise passes (compiled with compiled=True) -----------------------------------------


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 if it already is (float64 inputs keep their precision: gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _forward_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of the label, logsumexp), both float32 (rows,)."""
    x = _wide(logits)
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    return lp, lse


def _forward_stats_entropy(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob of the label, logsumexp, entropy), all float32 (rows,)."""
    x = _wide(logits)
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.exp(x - lse.unsqueeze(-1)) * x).sum(-1)
    return lp, lse, entropy


def _grad_logits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad_lp: torch.Tensor) -> torch.Tensor:
    """d(sum grad_lp * lp) / d logits = grad_lp * (onehot(label) - softmax), in the logits' dtype."""
    g = torch.exp(_wide(logits) - lse.unsqueeze(-1)).mul_(-grad_lp.unsqueeze(-1))
    g.scatter_add_(-1, labels.unsqueeze(-1), grad_lp.unsqueeze(-1))
    return g.to(logits.dtype)


def _grad_logits_entropy(
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    grad_lp: torch.Tensor,
    entropy: torch.Tensor,
    grad_entropy: torch.Tensor,
) -> torch.Tensor:
    """``_grad_logits`` plus d(sum grad_entropy * H) / d logits, with dH/dz = -p (log p + H)."""
    x = _wide(logits)
    log_p = x - lse.unsqueeze(-1)
    g = torch.exp(log_p) * -(grad_lp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (log_p + entropy.unsqueeze(-1)))
    g.scatter_add_(-1, labels.unsqueeze(-1), grad_lp.unsqueeze(-1))
    return g.to(logits.dtype)


def _rows_dynamic(fn: Callable) -> Callable:
    """``fn`` compiled for any number of rows and the vocabulary size it first sees: only the row count
    is symbolic, so the kernels index the vocabulary with a constant (a symbolic width makes every
    element's row and column a runtime division). View arguments are passed as copies: dynamo guards on
    a view's base (whose size changes with the microbatch, not the chunk); the copies are (rows,)
    vectors."""
    compiled = torch.compile(fn, dynamic=None)

    def call(*ts: torch.Tensor) -> Any:
        ts = tuple(t.clone() if t._is_view() else t for t in ts)
        for t in ts:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*ts)

    return call


_PASSES = (_forward_stats, _forward_stats_entropy, _grad_logits, _grad_logits_entropy)


@functools.cache
def _compiled_passes() -> tuple[Callable, Callable, Callable, Callable]:
    """The four passes through ``torch.compile``, compiled once per process (``_rows_dynamic``)."""
    stats, stats_entropy, grad_logits, grad_logits_entropy = (_rows_dynamic(fn) for fn in _PASSES)
    return stats, stats_entropy, grad_logits, grad_logits_entropy


@functools.cache
def _addmm_into_float32(device_type: str) -> bool:
    """Whether this torch multiplies low-precision matrices straight into a float32 result on this kind
    of device (``torch.addmm(..., out_dtype=torch.float32)``, CUDA): the head's weight gradient then
    accumulates inside the matmul, not through a low-precision product added to it afterwards."""
    try:
        acc = torch.zeros(2, 2, device=device_type)
        m = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.addmm(acc, m, m, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((acc == 2).all())


def _passes(compiled: bool) -> tuple[Callable, Callable, Callable, Callable]:
    """The four elementwise passes, eager or compiled."""
    return _compiled_passes() if compiled else _PASSES


def _chunks(n: int, chunk_tokens: int) -> list[slice]:
    """Row slices of ``chunk_tokens`` rows; a lone last row joins the chunk before it, since a chunk of
    one row would make the compiled passes specialise (and recompile) on size 1."""
    starts = list(range(0, n, chunk_tokens))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [slice(s, e) for s, e in zip(starts, starts[1:] + [n])]


# --- forward / backward ------------------------------------------------------------------------------


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_tokens: int,
    want_entropy: bool,
    compiled: bool,
    kept: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_probs, logsumexp, entropy) float32 (N,); entropy is empty unless ``want_entropy``. Each
    chunk's logits are appended to ``kept`` when it is given."""
    fwd, fwd_ent, _, _ = _passes(compiled)
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
    lse = torch.empty_like(lp)
    entropy = torch.empty_like(lp) if want_entropy else lp.new_empty(0)
    for sl in _chunks(n, chunk_tokens):
        logits = F.linear(hidden[sl], weight, bias)
        if kept is not None:
            kept.append(logits)
        if want_entropy:
            lp[sl], lse[sl], entropy[sl] = fwd_ent(logits, labels[sl])
        else:
            lp[sl], lse[sl] = fwd(logits, labels[sl])
    return lp, lse, entropy


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
        want_entropy: bool,
        compiled: bool,
        keep_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kept: list[torch.Tensor] | None = [] if keep_logits else None
        lp, lse, entropy = _forward(hidden, weight, bias, labels, chunk_tokens, want_entropy, compiled, kept)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, *(kept or ()))
        ctx.chunk_tokens, ctx.compiled = chunk_tokens, compiled
        # An unused output's gradient arrives as None (not zeros): no entropy term unless a loss uses it.
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_lp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hidden, weight, bias, labels, lse, entropy, *kept = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        _, _, grad_pass, grad_entropy_pass = _passes(ctx.compiled)
        grad_lp = _wide(grad_lp) if grad_lp is not None else lse.new_zeros(lse.shape)
        if grad_entropy is not None:
            grad_entropy = _wide(grad_entropy)
        chunks = _chunks(hidden.shape[0], ctx.chunk_tokens)
        # A single chunk writes the weight's gradient directly; several accumulate in float32 when the
        # weight is lower precision (bf16 sums of chunk partials would round away small contributions).
        acc_dtype = weight.dtype if len(chunks) == 1 else torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        for i, sl in enumerate(chunks):
            h = hidden[sl]
            logits = kept[i] if kept else F.linear(h, weight, bias)  # kept: one per chunk, or none
            if grad_entropy is None:
                g = grad_pass(logits, lse[sl], labels[sl], grad_lp[sl])
            else:
                g = grad_entropy_pass(logits, lse[sl], labels[sl], grad_lp[sl], entropy[sl], grad_entropy[sl])
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[sl])
            if grad_w is not None:
                if acc_dtype == weight.dtype:
                    grad_w.addmm_(g.t(), h)
                elif _addmm_into_float32(grad_w.device.type) and acc_dtype == torch.float32:
                    torch.addmm(grad_w, g.t(), h, out_dtype=acc_dtype, out=grad_w)
                else:
                    grad_w.add_(g.t() @ h)
            if grad_b is not None:
                grad_b.add_(g.sum(0, dtype=acc_dtype))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    want_entropy: bool = False,
    compiled: bool = False,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(hidden @ weight.T + bias)[i, labels[i]]`` and the distribution's entropy, per row.

    hidden (N, H) and weight (V, H) in the model's dtype, bias (V,) or None, labels (N,) long. Returns
    float32 (N,) log-probs and float32 (N,) entropies (an empty tensor unless ``want_entropy``), both
    differentiable w.r.t. hidden, weight and bias; float64 inputs give float64 outputs.
    ``compiled``: run the float32 elementwise passes through ``torch.compile``. ``keep_logits``: keep
    the forward's logits for the backward (N x V in the model's dtype) instead of recomputing them; the
    same gradients. Without grad (or with no input requiring it) nothing is saved.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        lp, _, entropy = _forward(hidden, weight, bias, labels, chunk_tokens, want_entropy, compiled)
        return lp, entropy
    return _LinearLogProbs.apply(hidden, weight, bias, labels, chunk_tokens, want_entropy, compiled, keep_logits)
