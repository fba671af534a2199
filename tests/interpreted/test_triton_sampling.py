"""The one-pass sampling kernel, run by Triton's CPU interpreter: for the same logits, bias, temperature
and Exp(1) noise it must pick the tokens ``sample_math`` picks (ties to the first index) and give their
temperature-1 log-probs; the noise it makes is Philox4x32-10 as documented, checked against an
implementation written out here and the generator's published test vectors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_triton_decode_attention import _interpreter_scalars  # noqa: F401  # the interpreter's scalar loads

from rlvr.engines.fast.kernels.sampling import CounterNoise, exponential_noise, sampling_slices, triton_sample
from rlvr.engines.fast.step import sample_math


def _counter(rows: int, seed: int, step: int = 3) -> CounterNoise:
    keys = torch.tensor([5 * r + 1 for r in range(rows)])
    return CounterNoise(torch.tensor([seed]), torch.tensor([step]), keys)


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    bias = torch.zeros(vocab)
    bias[-5:] = float("-inf")  # ids a tokenizer cannot decode
    bias[logits[0].float().argmax()] = float("-inf")  # row 0's greedy winner is barred
    counter = _counter(rows, seed)
    return logits, bias, counter, exponential_noise(counter, vocab)


# Philox4x32-10 written out from its definition (Salmon et al., "Parallel random numbers: as easy as
# 1, 2, 3", SC 2011): ten rounds, the key bumped between rounds.
def _philox4x32_10(key: tuple[int, int], ctr: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    mask = 0xFFFFFFFF
    k0, k1 = key
    c0, c1, c2, c3 = ctr
    for _ in range(10):
        p0, p2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p2 >> 32) ^ c1 ^ k0) & mask, p2 & mask, ((p0 >> 32) ^ c3 ^ k1) & mask, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def test_philox_written_out_meets_the_published_vectors():
    """Random123's known-answer vectors for philox4x32 with 10 rounds (kat_vectors)."""
    assert _philox4x32_10((0, 0), (0, 0, 0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 0xFFFFFFFF
    assert _philox4x32_10((ones, ones), (ones,) * 4) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert _philox4x32_10((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1,
    )  # fmt: skip


def _exponential_by_hand(seed: int, row_key: int, step: int, v: int) -> float:
    """Entry v of a row's noise as the module's docstring defines it: output v % 4 of Philox keyed by the
    seed's low and high words with counter (v // 4, row key, step, 0); its low 31 bits (the sign folded)
    as a uniform in (0, 1) with half a step added; then -log(1 - u)."""
    word = _philox4x32_10((seed & 0xFFFFFFFF, seed >> 32), (v // 4, row_key, step, 0))[v % 4]
    signed = word - (1 << 32) if word >= 1 << 31 else word
    folded = -signed - 1 if signed < 0 else signed
    u = float(np.float32(np.float32(folded) * np.float32(4.6566127342e-10)) + np.float32(2.3283064e-10))
    return -math.log1p(-u)


def test_noise_is_philox_as_documented():
    """Values of ``exponential_noise`` against the definition worked out in Python (float64 there,
    float32 in the kernel), at entries of every output word, two row keys, a 64-bit seed and steps 0, 7."""
    seed = (0x1234_5678 << 32) | 0x9ABC_DEF0
    for step in (0, 7):
        counter = CounterNoise(torch.tensor([seed]), torch.tensor([step]), torch.tensor([0, 41]))
        noise = exponential_noise(counter, 1030)
        for r, key in enumerate((0, 41)):
            for v in (0, 1, 2, 3, 4, 5, 1023, 1024, 1029):
                assert noise[r, v].item() == pytest.approx(_exponential_by_hand(seed, key, step, v), rel=1e-5)
    assert noise.shape == (2, 1030) and bool((noise > 0).all())


def test_noise_depends_on_seed_step_and_row_key_only():
    """The same key gives the same row wherever it sits; another key, step or seed, other draws; rows of
    the written-out noise match Exp(1) in their mean and spread."""
    a = exponential_noise(CounterNoise(torch.tensor([9]), torch.tensor([2]), torch.tensor([3, 8])), 4096)
    b = exponential_noise(CounterNoise(torch.tensor([9]), torch.tensor([2]), torch.tensor([8, 3, 4])), 4096)
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0]) and not torch.equal(b[2], a[0])
    c = exponential_noise(CounterNoise(torch.tensor([9]), torch.tensor([3]), torch.tensor([3])), 4096)
    d = exponential_noise(CounterNoise(torch.tensor([10]), torch.tensor([2]), torch.tensor([3])), 4096)
    assert not torch.equal(c[0], a[0]) and not torch.equal(d[0], a[0])
    values = torch.cat([a, b, c, d]).double().flatten()  # 28,672 draws: mean 1 and variance 1, +- ~5 sigma
    assert values.mean().item() == pytest.approx(1.0, abs=0.03)
    assert values.var().item() == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "block", "slices"), [(1000, 64, None), (1000, 64, 3), (777, 128, 1), (300, 512, 2)])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_kernel_equals_sample_math(dtype, vocab, block, slices, mode):
    """Vocabularies that end inside a block, slices that split it at several places (and one slice, and
    a block longer than the vocabulary), a barred token, temperature 0.7."""
    logits, bias, counter, noise = _case(5, vocab, dtype, seed=vocab + block)
    temperature = torch.tensor([0.7])
    tokens, lp = sample_math(logits, bias, temperature, torch.ones(1), noise, mode)
    got, got_lp = triton_sample(
        logits, bias, temperature, None if mode == "greedy" else counter, slices=slices, block=block
    )
    assert got.dtype == torch.long and got_lp.dtype == torch.float32
    assert torch.equal(got, tokens)
    torch.testing.assert_close(got_lp, lp, rtol=0, atol=1e-5)
    assert got[0] != logits[0].float().argmax() or mode == "sample"


def test_ties_go_to_the_first_index():
    """Equal best scores in two lanes of one slice, in one lane (a block apart), and in three slices: the
    earliest index wins, as with ``argmax``; a row of equal logits gives token 0."""
    vocab = 1000  # 3 slices of 384 (6 blocks of 64)
    logits = torch.zeros(4, vocab)
    logits[0, [350, 351, 900]] = 5.0  # lanes 30 and 31 of one slice, and a later slice
    logits[1, [164, 100]] = 5.0  # lane 36 of slice 0, one block apart
    logits[2, [999, 420, 100]] = 5.0  # one in each slice
    got, _ = triton_sample(logits, torch.zeros(vocab), torch.ones(1), None, slices=3, block=64)
    assert got.tolist() == [350, 100, 100, 0]


def test_bad_inputs_are_refused():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="contiguous"):
        triton_sample(logits.t().contiguous().t(), torch.zeros(100), torch.ones(1), None)
    with pytest.raises(ValueError, match="2 row keys"):
        triton_sample(logits, torch.zeros(100), torch.ones(1), _counter(3, seed=1))
    with pytest.raises(ValueError, match="power of two"):
        triton_sample(logits, torch.zeros(100), torch.ones(1), None, block=2)
    with pytest.raises(ValueError, match="vocab_bias"):
        triton_sample(logits, torch.zeros(100, dtype=torch.float64), torch.ones(1), None)


def test_slices_by_hand():
    """Enough programs (rows x slices, 2,048 aimed for) at few rows, no slice but the last under 2
    blocks of 1,024 entries."""
    assert sampling_slices(256, 100_352) == 8
    assert sampling_slices(32, 100_352) == 49  # 64 wanted, 49 slices of >= 2 blocks fit
    assert sampling_slices(32, 151_936) == 64
    assert sampling_slices(1, 1_000) == 1
