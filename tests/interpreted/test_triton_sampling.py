"""The one-pass sampling kernel, run by Triton's CPU interpreter: for the same logits, bias, temperature
and Exp(1) noise it must pick the tokens ``sample_math`` picks (ties to the first index) and give their
temperature-1 log-probs."""

from __future__ import annotations

import pytest
import torch
from test_triton_decode_attention import _interpreter_scalars  # noqa: F401  # the interpreter's scalar loads

from rlvr.engines.fast.step import sample_math
from rlvr.engines.sampling_kernel import sampling_slices, triton_sample


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    bias = torch.zeros(vocab)
    bias[-5:] = float("-inf")  # ids a tokenizer cannot decode
    bias[logits[0].float().argmax()] = float("-inf")  # row 0's greedy winner is barred
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    return logits, bias, noise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "block", "slices"), [(1000, 64, None), (1000, 64, 3), (777, 128, 1), (300, 512, 2)])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_kernel_equals_sample_math(dtype, vocab, block, slices, mode):
    """Vocabularies that end inside a block, slices that split it at several places (and one slice, and
    a block longer than the vocabulary), a barred token, temperature 0.7."""
    logits, bias, noise = _case(5, vocab, dtype, seed=vocab + block)
    temperature = torch.tensor([0.7])
    tokens, lp = sample_math(logits, bias, temperature, torch.ones(1), noise, mode)
    got, got_lp = triton_sample(
        logits, bias, temperature, None if mode == "greedy" else noise, slices=slices, block=block
    )
    assert got.dtype == torch.long and got_lp.dtype == torch.float32
    assert torch.equal(got, tokens)
    torch.testing.assert_close(got_lp, lp, rtol=0, atol=1e-5)
    assert got[0] != logits[0].float().argmax() or mode == "sample"


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_ties_go_to_the_first_index(mode):
    """Equal best scores in two lanes of one slice, in one lane (a block apart), and in three slices: the
    earliest index wins, as with ``argmax``; a row of equal logits gives token 0."""
    vocab = 1000  # 3 slices of 384 (6 blocks of 64)
    logits = torch.zeros(4, vocab)
    logits[0, [350, 351, 900]] = 5.0  # lanes 30 and 31 of one slice, and a later slice
    logits[1, [164, 100]] = 5.0  # lane 36 of slice 0, one block apart
    logits[2, [999, 420, 100]] = 5.0  # one in each slice
    noise = torch.ones(4, vocab)  # log 1 = 0: the race reduces to the scores
    got, _ = triton_sample(
        logits, torch.zeros(vocab), torch.ones(1), None if mode == "greedy" else noise, slices=3, block=64
    )
    assert got.tolist() == [350, 100, 100, 0]


def test_bad_inputs_are_refused():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="contiguous"):
        triton_sample(logits.t().contiguous().t(), torch.zeros(100), torch.ones(1), None)
    with pytest.raises(ValueError, match="the logits. shape"):
        triton_sample(logits, torch.zeros(100), torch.ones(1), torch.ones(3, 100))
    with pytest.raises(ValueError, match="vocab_bias"):
        triton_sample(logits, torch.zeros(100, dtype=torch.float64), torch.ones(1), None)


def test_slices_by_hand():
    """Enough programs (rows x slices, 2,048 aimed for) at few rows, no slice but the last under 2
    blocks of 1,024 entries."""
    assert sampling_slices(256, 100_352) == 8
    assert sampling_slices(32, 100_352) == 49  # 64 wanted, 49 slices of >= 2 blocks fit
    assert sampling_slices(32, 151_936) == 64
    assert sampling_slices(1, 1_000) == 1
