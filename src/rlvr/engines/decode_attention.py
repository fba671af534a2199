"""One decode step's attention over a shared prompt cache and a per-row response cache.

``FastHFEngine`` keeps a group's prompt K/V once, however many samples the group has, and each row's
response K/V on its own:

* ``pk``, ``pv``: (groups, heads, prompt_slots, head_dim); group g's prompt fills slots
  ``[start, plen)`` (left-padded to the chunk's longest prompt, ``plen``);
* ``rk``, ``rv``: (rows, heads, response_slots, head_dim); every row of a chunk starts generating at
  the same step, so response slot j holds every row's j-th new token and slots ``[0, rlen)`` are
  filled.

Row r attends to its group's prompt slots ``[start[r], plen)`` and its response slots ``[0, rlen)``.
Sharing the prompt cuts the cache by (n - 1) x prompt length per group, and the samples of a group,
decoded side by side, read their prompt K/V from the GPU's L2 cache instead of from memory.

Two implementations compute the same thing:

* ``reference_decode_attention``: gathers each row's prompt K/V, concatenates them with its response
  K/V and calls ``scaled_dot_product_attention`` under a mask. Any device; the CPU tests' ground truth.
* ``triton_decode_attention``: one Triton program per (row, head) streams the prompt blocks and then
  the response blocks with an online softmax in float32, kept per lane of the block so that the loop
  has no reduction across the block (merged once at the end). The lengths are read on the device, so
  a CUDA graph captured once serves every step.

Both take the lengths as device tensors (``plen``, ``rlen``: shape (1,)), so neither syncs the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch; the engine falls back to the reference without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def reference_decode_attention(q, pk, pv, rk, rv, grp, start, plen, rlen, prompt_slots: int, response_slots: int):
    """Attention of one query per row, q (b, heads, 1, head_dim), over the row's prompt and response slots.

    ``prompt_slots`` / ``response_slots`` are how many leading slots of each cache to read (at least
    ``plen`` / ``rlen``; masked beyond them). Returns (b, heads, 1, head_dim) in q's dtype.
    """
    b = q.shape[0]
    keys = torch.cat([pk[grp[:b], :, :prompt_slots], rk[:b, :, :response_slots]], dim=2)
    values = torch.cat([pv[grp[:b], :, :prompt_slots], rv[:b, :, :response_slots]], dim=2)
    pcols = torch.arange(prompt_slots, device=q.device)
    rcols = torch.arange(response_slots, device=q.device)
    mask = torch.cat([(pcols[None, :] >= start[:b, None]) & (pcols[None, :] < plen),
                      (rcols < rlen).expand(b, -1)], dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :])


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _accumulate(kbase, vbase, lo, hi, first, stride_s, q, d, m, l, acc, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        """Online softmax over slots [max(lo, first), hi) of one (row, head), kept per lane: lane j of
        the block sees slots j, j + BLOCK, ... and holds its own running max ``m``, sum ``l`` and
        weighted values ``acc`` (BLOCK, D). Every step is elementwise but the q.k dot; the lanes are
        merged once, at the end. ``STAGES``: loads of the next blocks issued while this one is reduced."""
        for s in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            offs = s + tl.arange(0, BLOCK)
            ok = (offs >= first) & (offs < hi)
            k = tl.load(kbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            x = tl.where(ok, tl.sum(k * q[None, :], axis=1), -float("inf"))
            m_new = tl.maximum(m, x)
            alpha = tl.exp(m - m_new)
            p = tl.exp(x - m_new)
            v = tl.load(vbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + p[:, None] * v
            l = l * alpha + p
            m = m_new
        return m, l, acc

    @triton.jit
    def _decode_attention_kernel(Q, PK, PV, RK, RV, GRP, START, PLEN, RLEN, OUT,
                                 sq_b, sq_h, sp_g, sp_h, sp_s, sr_b, sr_h, sr_s, so_b, so_h, scale,
                                 D: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, D)
        q = tl.load(Q + row * sq_b + head * sq_h + d).to(tl.float32) * scale
        grp = tl.load(GRP + row).to(tl.int64)
        first = tl.load(START + row).to(tl.int32)
        plen = tl.load(PLEN).to(tl.int32)
        rlen = tl.load(RLEN).to(tl.int32)
        # A finite floor for the running max: a lane that has seen no slot yet rescales by exp(0) = 1
        # and contributes exp(-1e30 - max) = 0 at the merge.
        m = tl.full([BLOCK], -1e30, tl.float32)
        l = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D], tl.float32)
        # The prompt: blocks from the one holding the row's first real slot (every row has one).
        poff = grp * sp_g + head * sp_h
        m, l, acc = _accumulate(PK + poff, PV + poff, (first // BLOCK) * BLOCK, plen, first, sp_s, q, d, m, l, acc, BLOCK, STAGES)
        roff = row * sr_b + head * sr_h
        m, l, acc = _accumulate(RK + roff, RV + roff, 0, rlen, 0, sr_s, q, d, m, l, acc, BLOCK, STAGES)
        top = tl.max(m, axis=0)
        w = tl.exp(m - top)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(OUT + row * so_b + head * so_h + d, out.to(OUT.dtype.element_ty))


def triton_decode_attention(q, pk, pv, rk, rv, grp, start, plen, rlen, block: int = 16, num_warps: int = 2,
                            num_stages: int = 2):
    """``reference_decode_attention`` as one Triton kernel (CUDA, or the Triton interpreter on CPU).

    The defaults were the fastest of those timed on an H200 at the suggested config's shapes
    (docs/benchmarks.md, "decode attention")."""
    if triton is None:
        raise RuntimeError("triton is not installed; use reference_decode_attention")
    b, heads, one, head_dim = q.shape
    if one != 1:
        raise ValueError(f"decode attention takes one query per row, got {one}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton decode attention needs a power-of-two head_dim, got {head_dim}")
    for t in (pk, pv, rk, rv):
        if t.stride(-1) != 1:
            raise ValueError("the K/V caches must be contiguous in head_dim")
    if pk.stride() != pv.stride() or rk.stride() != rv.stride():
        raise ValueError("K and V caches must share their layout")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((b, heads, 1, head_dim), dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(b, heads)](
        q, pk, pv, rk, rv, grp, start, plen, rlen, out,
        q.stride(0), q.stride(1), pk.stride(0), pk.stride(1), pk.stride(2), rk.stride(0), rk.stride(1), rk.stride(2),
        out.stride(0), out.stride(1), head_dim ** -0.5, D=head_dim, BLOCK=block, STAGES=num_stages, num_warps=num_warps,
    )
    return out
