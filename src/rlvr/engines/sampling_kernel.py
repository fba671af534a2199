"""One token per row from a decode step's logits, in one pass over the vocabulary.

Computes what ``rlvr.engines.fast.step.sample_math`` computes for greedy and plain temperature sampling
(top-p sorts the vocabulary and stays there), for the same Exp(1) noise: the exponential race
``argmax_i (score_i - log E_i)`` with ``score = logit + bias`` (divided by the temperature when sampling),
the first index among equal maxima, and the token's temperature-1 log-prob ``logit - logsumexp(logits)``.

``sample_math``, compiled, reads each row's logits and noise in several kernels (float32 cast,
logsumexp, the race, the gather); here one program per (row, slice of the vocabulary) reads each value
once, keeping per lane a running max and sum for the logsumexp and a running best score, and a second,
small kernel merges a row's slices. The slices keep the GPU busy when the batch has few rows.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; the engine samples with sample_math without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# The fastest of a sweep on an H200 (docs/benchmarks.md, "Sampling in one pass"): many short slices keep
# enough loads in flight, since each program's loop is one chain of dependent steps.
BLOCK = 1024  # vocabulary entries per lane step
WARPS = 8
PROGRAMS = 2048  # programs a call aims for (rows x slices)
MIN_SLICE_BLOCKS = 2  # a slice is at least this many blocks long: fewer partial results to merge


if triton is not None:

    @triton.jit
    def _sample_slices(  # type: ignore[no-untyped-def]  # Triton reads a kernel's annotations; only constexpr ones here
        logits,
        bias,
        temperature,
        noise,
        part_m,
        part_s,
        part_best,
        part_idx,
        vocab,
        chunk,
        stride_logits,
        stride_noise,
        SLICES: tl.constexpr,
        BLOCK: tl.constexpr,
        GREEDY: tl.constexpr,
    ):
        """Program (row, slice): vocabulary entries [slice * chunk, (slice + 1) * chunk) of one row. Lane j
        sees entries j, j + BLOCK, ... and keeps its own running max ``m`` and sum ``s`` of exp(logit - m),
        and its best score and that score's index (the earliest: indices only grow along a lane); the
        lanes are merged once, at the end, into the slice's (max, sum, best score, index)."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        lo = part * chunk
        hi = tl.minimum(lo + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        idx = lo + offs
        if not GREEDY:
            t = tl.load(temperature)
        for start in range(lo, hi, BLOCK):
            i = start + offs
            ok = i < hi
            x = tl.load(logits + row * stride_logits + i, mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # A lane that has seen only masked entries keeps m = -inf and s = 0: subtracting 0 there
            # instead of m_new avoids exp(-inf - -inf), which is nan.
            shift = tl.where(m_new > float("-inf"), m_new, 0.0)
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
            score = x + tl.load(bias + i, mask=ok, other=0.0)
            if not GREEDY:
                e = tl.load(noise + row * stride_noise + i, mask=ok, other=1.0)
                score = score / t - tl.log(tl.maximum(e, 1e-30))
            score = tl.where(ok, score, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            idx = tl.where(better, i, idx)
        top = tl.max(m, axis=0)
        out = row * SLICES + part
        tl.store(part_m + out, top)
        tl.store(part_s + out, tl.sum(s * tl.exp(m - top), axis=0))
        winner = tl.max(best, axis=0)
        tl.store(part_best + out, winner)
        tl.store(part_idx + out, tl.min(tl.where(best == winner, idx, vocab), axis=0))

    @triton.jit
    def _merge_slices(  # type: ignore[no-untyped-def]
        logits,
        part_m,
        part_s,
        part_best,
        part_idx,
        tokens,
        logprobs,
        stride_logits,
        SLICES: tl.constexpr,
        SLICES_P2: tl.constexpr,
    ):
        """Program row: the logsumexp over the row's slices, the token of the best slice (the first of equal
        ones, so the earliest index overall), and the token's logit minus the logsumexp."""
        row = tl.program_id(0)
        j = tl.arange(0, SLICES_P2)
        ok = j < SLICES
        at = row * SLICES + j
        m = tl.load(part_m + at, mask=ok, other=float("-inf"))
        s = tl.load(part_s + at, mask=ok, other=0.0)
        best = tl.load(part_best + at, mask=ok, other=float("-inf"))
        idx = tl.load(part_idx + at, mask=ok, other=2147483647)
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        winner = tl.max(best, axis=0)
        # slices cover increasing index ranges, so the smallest index among the best slices is the first
        token = tl.min(tl.where(best == winner, idx, 2147483647), axis=0)
        logit = tl.load(logits + row * stride_logits + token).to(tl.float32)
        tl.store(tokens + row, token.to(tl.int64))
        tl.store(logprobs + row, logit - lse)


def sampling_slices(rows: int, vocab: int) -> int:
    """Slices of the vocabulary per row: enough programs to fill the GPU at few rows, each slice but the
    last at least ``MIN_SLICE_BLOCKS`` blocks long."""
    most = max(1, -(-vocab // (MIN_SLICE_BLOCKS * BLOCK)))
    return max(1, min(most, -(-PROGRAMS // rows)))


def triton_sample(
    logits: torch.Tensor,
    vocab_bias: torch.Tensor,
    temperature: torch.Tensor,
    noise: torch.Tensor | None,
    slices: int | None = None,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (b,) int64 and their temperature-1 log-probs (b,) float32 for ``logits`` (b, vocab), as
    ``sample_math``: greedy when ``noise`` is None, else the exponential race with ``noise`` (b, vocab),
    Exp(1) draws, and ``temperature`` (1,) on the device. ``vocab_bias`` (vocab,) float32 is added to the
    scores (-inf bars a token). ``slices`` of the vocabulary per row: ``sampling_slices`` by default;
    ``block``: entries per lane step (a power of two; smaller ones let the tests cross blocks).
    Fixed shapes and no host sync: capturable in a CUDA graph."""
    if triton is None:
        raise RuntimeError("triton_sample needs the triton package (it ships with CUDA builds of torch)")
    b, vocab = logits.shape
    if noise is not None and noise.shape != logits.shape:
        raise ValueError(f"noise must have the logits' shape {tuple(logits.shape)}, got {tuple(noise.shape)}")
    if logits.stride(1) != 1 or (noise is not None and noise.stride(1) != 1):
        raise ValueError("triton_sample needs each row of the logits and the noise contiguous")
    if vocab_bias.shape != (vocab,) or vocab_bias.dtype != torch.float32:
        raise ValueError(f"vocab_bias must be float32 of shape ({vocab},), got {vocab_bias.dtype} {vocab_bias.shape}")
    per_slice = -(-vocab // (slices or sampling_slices(b, vocab)))
    chunk = -(-per_slice // block) * block  # each slice a whole number of blocks
    slices = -(-vocab // chunk)  # and none left empty
    parts = torch.empty((3, b * slices), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(b * slices, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    greedy = noise is None
    _sample_slices[(b, slices)](
        logits,
        vocab_bias,
        temperature,
        logits if greedy else noise,
        parts[0],
        parts[1],
        parts[2],
        part_idx,
        vocab,
        chunk,
        logits.stride(0),
        0 if greedy else noise.stride(0),
        SLICES=slices,
        BLOCK=block,
        GREEDY=greedy,
        num_warps=WARPS,
    )
    _merge_slices[(b,)](
        logits,
        parts[0],
        parts[1],
        parts[2],
        part_idx,
        tokens,
        logprobs,
        logits.stride(0),
        SLICES=slices,
        SLICES_P2=triton.next_power_of_2(slices),
        num_warps=1,
    )
    return tokens, logprobs
