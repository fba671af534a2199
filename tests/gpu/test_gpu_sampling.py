"""The one-pass sampling kernel on a GPU against ``sample_math`` (eager and compiled, as the SDPA path and
top-p run it) at the supported families' vocabulary sizes and batch sizes from 1 to 256: the same tokens
for the same Exp(1) noise, and the same temperature-1 log-probs."""

from __future__ import annotations

import pytest
import torch

from rlvr.engines.decode_attention import triton_available
from rlvr.engines.fast import step as S
from rlvr.engines.sampling_kernel import triton_sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]


@pytest.mark.parametrize("vocab", [100_352, 128_256, 151_936])
@pytest.mark.parametrize("rows", [1, 32, 256])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_kernel_equals_sample_math(vocab, rows, mode):
    g = torch.Generator(device="cuda").manual_seed(vocab + rows)
    logits = (4 * torch.randn(rows, vocab, generator=g, device="cuda")).to(torch.bfloat16)
    bias = torch.zeros(vocab, device="cuda")
    bias[-100:] = float("-inf")  # ids a tokenizer cannot decode
    noise = torch.empty(rows, vocab, device="cuda").exponential_(generator=g)
    temperature = torch.tensor([0.8], device="cuda")
    top_p = torch.ones(1, device="cuda")
    tokens, lp = triton_sample(logits, bias, temperature, None if mode == "greedy" else noise)
    for fn in (S.sample_math, S.compiled(S.sample_math, key="gpu_test")):
        want, want_lp = fn(logits, bias, temperature, top_p, noise, mode)
        # Different log implementations could flip a race decided within a float32 ulp, which random
        # rows practically never are: no difference is allowed.
        assert torch.equal(tokens, want)
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-4)


def test_kernel_samples_from_the_softmax():
    """20,000 rows over a 50-token softmax at temperature 0.7 (the rest of an 8,192 vocabulary barred):
    the token counts fit the tempered probabilities (chi-square, 49 degrees of freedom)."""
    vocab, rows, temp = 8_192, 20_000, 0.7
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.zeros(rows, vocab, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(50, generator=g, device="cuda").to(torch.bfloat16)
    logits[:, :50] = row
    bias = torch.full((vocab,), float("-inf"), device="cuda")
    bias[:50] = 0
    noise = torch.empty(rows, vocab, device="cuda").exponential_(generator=g)
    tokens, lp = triton_sample(logits, bias, torch.tensor([temp], device="cuda"), noise)
    p = torch.softmax(row.float() / temp, dim=-1)
    counts = torch.bincount(tokens, minlength=50).float()
    assert counts.sum() == rows and counts.numel() == 50
    chi2 = ((counts - rows * p) ** 2 / (rows * p)).sum().item()
    assert chi2 < 90, chi2  # the 0.9999 quantile of chi-square(49) is about 93
    # the log-prob is temperature 1 over the whole vocabulary (the barred ids' logits are 0, not -inf)
    lse = torch.logsumexp(logits[0].float(), dim=-1)
    torch.testing.assert_close(lp, logits[0].float()[tokens] - lse, rtol=0, atol=1e-4)
