"""One token per row from a decode step's logits, in one pass over the vocabulary, and the noise it races.

Computes what ``rlvr.engines.fast.step.sample_math`` computes for greedy and plain temperature sampling
(top-p sorts the vocabulary and stays there), for the same Exp(1) noise: the exponential race
``argmax_i (score_i - log E_i)`` with ``score = logit + bias`` (divided by the temperature when sampling),
the first index among equal maxima, and the token's temperature-1 log-prob ``logit - logsumexp(logits)``.

``sample_math``, compiled, reads each row's logits and noise in several kernels (float32 cast,
logsumexp, the race, the gather); here one program per (row, slice of the vocabulary) reads each value
once, keeping per lane a running max and sum for the logsumexp and a running best score, and a second,
small kernel merges a row's slices. The slices keep the GPU busy when the batch has few rows.

The noise is counter-based (``CounterNoise``): entry v of a row is made from Philox4x32-10 (the
generator ``torch``'s CUDA random numbers use) keyed by the call's seed, with the counter
(v // 4, the row's key, the step, 0), output v % 4. The kernel makes it where it reads the logits, so a
step neither writes nor reads a vocabulary-wide noise tensor, and a row's draws depend on its key and
the step only (not on where the row sits in the batch). ``exponential_noise`` writes the same values
out, for ``sample_math`` (top-p, the SDPA path) and the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:  # Triton ships with CUDA builds of PyTorch; the engine samples with sample_math without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# The fastest of a sweep on an H200 (docs/benchmarks_history.md, "Sampling in one pass"): many short slices keep
# enough loads in flight, since each program's loop is one chain of dependent steps.
BLOCK = 1024  # vocabulary entries per lane step
WARPS = 8
PROGRAMS = 2048  # programs a call aims for (rows x slices)
MIN_SLICE_BLOCKS = 2  # a slice is at least this many blocks long: fewer partial results to merge
NOISE_BLOCK = 1024  # entries per program of exponential_noise


class CounterNoise(NamedTuple):
    """Where a step's Exp(1) noise comes from, all on the device (so a captured graph replays it): the
    call's ``seed`` (1,) int64, the ``step`` (1,) int64, and each row's ``row_keys`` (b,) int64 (below 2**31)."""

    seed: torch.Tensor
    step: torch.Tensor
    row_keys: torch.Tensor


if triton is not None:

    @triton.jit
    def _exponential_block(seed, row_key, step, start, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Exp(1) draws for entries [start, start + BLOCK) of one row (``start`` a multiple of 4): entry v is
        output v % 4 of Philox4x32-10 with key ``seed`` and counter (v // 4, row_key, step, 0), as a
        uniform u in (0, 1) (31 random bits and half a step, so never 0), then -log(1 - u), summed as
        its series below 1/128 where 1 - u would round."""
        c = start // 4 + tl.arange(0, BLOCK // 4)
        zero = c * 0
        r0, r1, r2, r3 = tl.philox(seed, c, zero + row_key, zero + step, zero)
        r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # entry 4c + k holds r_k[c]
        u = tl.uint_to_uniform_float(r) + 2.3283064e-10
        return tl.where(u < 0.0078125, u * (1.0 + u * (0.5 + u * 0.33333334)), -tl.log(1.0 - u))

    @triton.jit
    def _exponential_noise(  # type: ignore[no-untyped-def]
        out, seed, step, row_keys, vocab, stride_out, BLOCK: tl.constexpr
    ):
        """Program (row, block): that block of the row's noise, as ``_sample_slices`` makes it."""
        row = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        key = tl.load(row_keys + row).to(tl.int32)
        e = _exponential_block(tl.load(seed), key, tl.load(step).to(tl.int32), start, BLOCK)
        i = start + tl.arange(0, BLOCK)
        tl.store(out + row * stride_out + i, e, mask=i < vocab)

    @triton.jit
    def _sample_slices(  # type: ignore[no-untyped-def]  # Triton reads a kernel's annotations; only constexpr ones here
        logits,
        bias,
        temperature,
        seed,
        step,
        row_keys,
        part_m,
        part_s,
        part_best,
        part_idx,
        vocab,
        chunk,
        stride_logits,
        SLICES: tl.constexpr,
        BLOCK: tl.constexpr,
        GREEDY: tl.constexpr,
    ):
        """Program (row, slice): vocabulary entries [slice * chunk, (slice + 1) * chunk) of one row. Lane j
        sees entries j, j + BLOCK, ... and keeps its own running max ``m`` and sum ``s`` of exp(logit - m),
        and its best score and that score's index (the earliest: indices only grow along a lane); the
        lanes are merged once, at the end, into the slice's (max, sum, best score, index). Sampling, each
        block's noise is made here (``_exponential_block``)."""
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
            key = tl.load(row_keys + row).to(tl.int32)
            seed_value = tl.load(seed)
            step_value = tl.load(step).to(tl.int32)
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
                e = _exponential_block(seed_value, key, step_value, start, BLOCK)
                score = score / t - tl.log(e)
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


def _check_noise(noise: CounterNoise, rows: int) -> None:
    if noise.row_keys.shape != (rows,) or noise.seed.numel() != 1 or noise.step.numel() != 1:
        raise ValueError(
            f"noise needs one seed, one step and {rows} row keys, got {noise.seed.numel()}, {noise.step.numel()} "
            f"and {tuple(noise.row_keys.shape)}"
        )


def exponential_noise(noise: CounterNoise, vocab: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Exp(1) draws ``triton_sample`` races against for ``noise``, written out: (rows, vocab) float32
    (into ``out`` when given, rows x at least ``vocab``, rows contiguous). Capturable in a CUDA graph."""
    if triton is None:
        raise RuntimeError("exponential_noise needs the triton package (it ships with CUDA builds of torch)")
    rows = noise.row_keys.shape[0]
    _check_noise(noise, rows)
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32, device=noise.row_keys.device)
    if out.shape[0] != rows or out.shape[1] < vocab or out.stride(1) != 1 or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 ({rows}, >= {vocab}) with contiguous rows")
    _exponential_noise[(rows, triton.cdiv(vocab, NOISE_BLOCK))](
        out, noise.seed, noise.step, noise.row_keys, vocab, out.stride(0), BLOCK=NOISE_BLOCK
    )
    return out[:, :vocab]


def triton_sample(
    logits: torch.Tensor,
    vocab_bias: torch.Tensor,
    temperature: torch.Tensor,
    noise: CounterNoise | None,
    slices: int | None = None,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (b,) int64 and their temperature-1 log-probs (b,) float32 for ``logits`` (b, vocab), as
    ``sample_math``: greedy when ``noise`` is None, else the exponential race against the draws of
    ``noise`` (``exponential_noise`` writes the same ones out) at ``temperature`` (1,), on the device.
    ``vocab_bias`` (vocab,) float32 is added to the scores (-inf bars a token). ``slices`` of the
    vocabulary per row: ``sampling_slices`` by default; ``block``: entries per lane step (a power of two,
    at least 4; smaller ones let the tests cross blocks). Fixed shapes and no host sync: capturable in a
    CUDA graph."""
    if triton is None:
        raise RuntimeError("triton_sample needs the triton package (it ships with CUDA builds of torch)")
    b, vocab = logits.shape
    if noise is not None:
        _check_noise(noise, b)
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 4, got {block}")
    if logits.stride(1) != 1:
        raise ValueError("triton_sample needs each row of the logits contiguous")
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
    seed, step, row_keys = (tokens, tokens, tokens) if noise is None else noise  # greedy reads none of them
    _sample_slices[(b, slices)](
        logits,
        vocab_bias,
        temperature,
        seed,
        step,
        row_keys,
        parts[0],
        parts[1],
        parts[2],
        part_idx,
        vocab,
        chunk,
        logits.stride(0),
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
