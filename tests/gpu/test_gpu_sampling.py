"""The one-pass sampling kernel on a GPU against ``sample_math`` (eager and compiled, as the SDPA path and
top-p run it) at the supported families' vocabulary sizes and batch sizes from 1 to 256: the same tokens
for the same Exp(1) noise (the kernel's counter-based draws, written out by ``exponential_noise``), and
the same temperature-1 log-probs; and draws that fit the tempered softmax."""

from __future__ import annotations

import pytest
import torch

from rlvr.engines.fast import step as S
from rlvr.engines.fast.kernels.decode_attention import triton_available
from rlvr.engines.fast.kernels.sampling import CounterNoise, exponential_noise, triton_sample


def _counter(rows: int, seed: int, step: int = 5) -> CounterNoise:
    def on_gpu(values):
        return torch.tensor(values, dtype=torch.long, device="cuda")

    return CounterNoise(on_gpu([seed]), on_gpu([step]), on_gpu([3 * r + 2 for r in range(rows)]))


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
    counter = _counter(rows, seed=vocab + rows)
    noise = exponential_noise(counter, vocab)
    temperature = torch.tensor([0.8], device="cuda")
    top_p = torch.ones(1, device="cuda")
    tokens, lp = triton_sample(logits, bias, temperature, None if mode == "greedy" else counter)
    for fn in (S.sample_math, S.compiled(S.sample_math, key="gpu_test")):
        want, want_lp = fn(logits, bias, temperature, top_p, noise, mode)
        # Different log implementations could flip a race decided within a float32 ulp, which random
        # rows practically never are: no difference is allowed.
        assert torch.equal(tokens, want)
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-4)


def test_kernel_samples_from_the_softmax():
    """20,000 rows (as many row keys) over a 50-token softmax at temperature 0.7 (the rest of an 8,192
    vocabulary barred): the token counts fit the tempered probabilities (chi-square, 49 degrees of
    freedom)."""
    vocab, rows, temp = 8_192, 20_000, 0.7
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.zeros(rows, vocab, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(50, generator=g, device="cuda").to(torch.bfloat16)
    logits[:, :50] = row
    bias = torch.full((vocab,), float("-inf"), device="cuda")
    bias[:50] = 0
    tokens, lp = triton_sample(logits, bias, torch.tensor([temp], device="cuda"), _counter(rows, seed=11))
    p = torch.softmax(row.float() / temp, dim=-1)
    counts = torch.bincount(tokens, minlength=50).float()
    assert counts.sum() == rows and counts.numel() == 50
    chi2 = ((counts - rows * p) ** 2 / (rows * p)).sum().item()
    assert chi2 < 90, chi2  # the 0.9999 quantile of chi-square(49) is about 93
    # the log-prob is temperature 1 over the whole vocabulary (the barred ids' logits are 0, not -inf)
    lse = torch.logsumexp(logits[0].float(), dim=-1)
    torch.testing.assert_close(lp, logits[0].float()[tokens] - lse, rtol=0, atol=1e-4)


def test_noise_written_out_matches_exp1():
    """38.9 million counter-based draws (256 rows of the Qwen vocabulary): the mean, the variance and the
    share above 10 of Exp(1), and no draw of 0."""
    noise = exponential_noise(_counter(256, seed=2**40 + 17), 151_936).double()
    assert bool((noise > 0).all())
    assert noise.mean().item() == pytest.approx(1.0, abs=0.005)
    assert noise.var().item() == pytest.approx(1.0, abs=0.01)
    # P(E > 10) = e^-10: about 1,766 of 38.9 million, +- 4 sigma
    assert abs((noise > 10).sum().item() - noise.numel() * 4.54e-5) < 4 * (noise.numel() * 4.54e-5) ** 0.5
