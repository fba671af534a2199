"""One decoder layer and the sampling, as pure functions of tensors, for every supported family.

A layer's step is: norm (pre-norm families), q/k/v projections, q/k norms and the rotary embedding
(``pre_attention``); the cache write and attention, left to the caller (in-place writes into the
static cache); then the output projection, norms, residuals and MLP (``post_attention``). The family
and the sizes enter as plain Python values, so the branches below are settled when the step is traced
and each family's compiled step holds only its own work. Written over plain tensors, one compiled
graph serves all layers (the weights are its inputs) and inductor fuses each piece's elementwise work
into a few kernels: at a 2,048-wide model a decode step is mostly kernel count, and eager it is about
50 kernels per layer.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, float32_scale: bool) -> torch.Tensor:
    """transformers' RMSNorm in one fused kernel: float32 statistics; the weight multiplies the float32
    values before the cast (``float32_scale``, OLMo-2) or the cast values (Llama, Qwen)."""
    if float32_scale:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rms_unfused(x: torch.Tensor, weight: torch.Tensor, eps: float, float32_scale: bool) -> torch.Tensor:
    """``rms`` written out as transformers' modules compute it (the ``fused_norms=False`` path)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype) if float32_scale else weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # transformers' apply_rotary_pos_emb; cos/sin come in the family's dtype (``rope_tables``).
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def rope_tables(
    pos: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype, float32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for position ids ``pos`` (any shape; a trailing head_dim axis is added), as the
    model's rotary module computes them: float32, cast to the model's dtype unless ``float32``."""
    freqs = pos.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return (cos, sin) if float32 else (cos.to(dtype), sin.to(dtype))


def project(x: torch.Tensor, ws: tuple, bs: tuple, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The projections of x whose outputs are ``sizes`` wide: one matmul with the weights' rows stacked
    (``ws`` = (stacked,), ``bs`` = (stacked bias or None,)), or one matmul per weight. Stacked, a decode
    step reads the same bytes in fewer, larger kernels."""
    if len(ws) == 1:
        return F.linear(x, ws[0], bs[0]).split(sizes, dim=-1)
    return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))


def _qk_norm_weights(
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_norm: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_norm is None or k_norm is None:
        raise ValueError(f"qk_norm={qk_norm!r} needs the q_norm and k_norm weights")
    return q_norm, k_norm


def pre_attention(
    x: torch.Tensor,
    norm1: torch.Tensor,
    wqkv: tuple,
    bqkv: tuple,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    pre_norm: bool,
    qk_norm: str | None,
    float32_scale: bool,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, heads, Q, D), k and v (B, kv_heads, Q, D) of one layer for hidden states x (B, Q, hidden)."""
    norm = rms if fused else rms_unfused
    B, Q, _ = x.shape
    h = norm(x, norm1, eps, float32_scale) if pre_norm else x
    q, k, v = project(h, wqkv, bqkv, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
    if qk_norm == "all_heads":
        qn, kn = _qk_norm_weights(q_norm, k_norm, qk_norm)
        q, k = norm(q, qn, eps, float32_scale), norm(k, kn, eps, float32_scale)
    q = q.view(B, Q, heads, head_dim)
    k = k.view(B, Q, kv_heads, head_dim)
    if qk_norm == "per_head":
        qn, kn = _qk_norm_weights(q_norm, k_norm, qk_norm)
        q, k = norm(q, qn, eps, float32_scale), norm(k, kn, eps, float32_scale)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(B, Q, kv_heads, head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v


def post_attention(
    x: torch.Tensor,
    o: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    wgate_up: tuple,
    bgate_up: tuple,
    wdown: torch.Tensor,
    bdown: torch.Tensor | None,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    eps: float,
    pre_norm: bool,
    float32_scale: bool,
    fused: bool,
) -> torch.Tensor:
    """The layer's output for input x (B, Q, hidden) and attention output o (B, heads, Q, D)."""
    norm = rms if fused else rms_unfused
    B, Q, _ = x.shape
    attn = F.linear(o.transpose(1, 2).reshape(B, Q, -1), wo, bo)
    if pre_norm:
        x = x + attn
        gate, up = project(norm(x, norm2, eps, float32_scale), wgate_up, bgate_up, (wdown.shape[1], wdown.shape[1]))
        return x + F.linear(act(gate) * up, wdown, bdown)
    x = x + norm(attn, norm1, eps, float32_scale)
    gate, up = project(x, wgate_up, bgate_up, (wdown.shape[1], wdown.shape[1]))
    return x + norm(F.linear(act(gate) * up, wdown, bdown), norm2, eps, float32_scale)


def sample_math(
    logits: torch.Tensor,
    vocab_bias: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their temperature-1 log-probs for logits (b, vocab); ``noise`` holds Exp(1) draws."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    scores = logits + vocab_bias
    if mode == "greedy":
        tokens = scores.argmax(dim=-1)
    else:
        scores = scores / temperature
        if mode == "top_p":
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            p_sorted = sorted_scores.softmax(dim=-1)
            drop = (p_sorted.cumsum(dim=-1) - p_sorted) >= top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
        # argmax p_i / E_i = argmax (log p_i - log E_i) = argmax (score_i - log E_i): the normaliser is
        # the same for every i, so no softmax pass is needed (-log E_i is Gumbel noise).
        tokens = (scores - noise.clamp_min(1e-30).log()).argmax(dim=-1)
    lp = logits.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, lp


@functools.cache
def compiled(
    fn: Callable[..., Any], key: str | None = None, dynamic: bool | None = None, options: tuple = ()
) -> Callable[..., Any]:
    """``torch.compile(fn)``, once per process and ``key``. Sizes start as constants and a size that changes
    between calls (the batch, the query length) becomes symbolic on the next compile, so one graph serves
    every batch bucket while the head count, head_dim and widths stay constants that inductor's kernels
    specialise on (``dynamic=True`` made them symbolic too). Each key compiles its own copy of ``fn``'s
    code: dynamo counts recompilations per code object and runs a function eagerly past 8 of them, so one
    family's shapes must not use up another's. ``dynamic`` and ``options`` (inductor settings as
    (name, value) pairs) are ``torch.compile``'s, for the probes that set other settings against these."""
    if key is not None:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{key}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        fn = functools.wraps(fn)(copy)
    return torch.compile(fn, dynamic=dynamic, options=dict(options) or None)
