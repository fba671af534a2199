"""The Triton decode-attention kernel, run by Triton's CPU interpreter: it must compute what the SDPA
reference computes, alone and inside the fast engine (greedy tokens, compaction, sampled log-probs)."""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_generate_reference
from test_decode_attention import per_row_softmax, random_case
from test_engines_fast import PROMPTS, _eos_prone, _fast, _ids, assert_logprobs_are_teacher_forced

from rlvr.engines.base import SamplingParams
from rlvr.engines.decode_attention import reference_decode_attention, triton_decode_attention


@pytest.fixture(autouse=True)
def _interpreter_scalars(monkeypatch):
    """Triton 3.6's interpreter turns a loaded scalar into a Python int with ``int(array)``, which numpy
    2.4 refuses for one-element arrays of rank 1; loop bounds read from memory (as the kernel's lengths
    are) need it. This reads the element instead and changes nothing else."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("rlen", [1, 8, 9, 19])
def test_kernel_equals_reference(block, rlen):
    """Block sizes that split the prompt and response at different places, a response of one slot, one
    exactly a block long, and a full one."""
    for seed in range(2):
        c = random_case(seed)
        ref = reference_decode_attention(**c, rlen=torch.tensor([rlen]), prompt_slots=c["pk"].shape[2],
                                         response_slots=c["rk"].shape[2])
        out = triton_decode_attention(**c, rlen=torch.tensor([rlen]), block=block)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        assert torch.allclose(out.double(), per_row_softmax(**c, rlen=rlen), atol=1e-5)


def test_kernel_reads_rows_beyond_the_batch_never():
    """The kernel runs one program per batch row: rows of the cache past the batch may hold anything."""
    c = random_case(4)
    rlen = torch.tensor([6])
    ref = triton_decode_attention(**c, rlen=rlen, block=8)
    c["rk"] = torch.cat([c["rk"], torch.full_like(c["rk"][:2], float("nan"))])
    c["rv"] = torch.cat([c["rv"], torch.full_like(c["rv"][:2], float("nan"))])
    assert torch.equal(triton_decode_attention(**c, rlen=rlen, block=8), ref)


def test_engine_greedy_equals_model_generate(tiny_model, tiny_tokenizer):
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    fast = _fast(tiny_model, tiny_tokenizer, attention="triton").generate(PROMPTS, params)
    assert [g[0].token_ids for g in fast] == greedy_generate_reference(tiny_model, tiny_tokenizer, PROMPTS, 20)
    sdpa = _fast(tiny_model, tiny_tokenizer, attention="sdpa").generate(PROMPTS, params)
    for f, s in zip(fast, sdpa):
        assert f[0].logprobs == pytest.approx(s[0].logprobs, abs=1e-5)


def test_engine_with_retired_rows_equals_sdpa_path(tiny_model, tiny_tokenizer):
    """Rows finishing at different steps are compacted; the kernel then reads prompts through ``grp``."""
    model = _eos_prone(tiny_model, tiny_tokenizer, boost=2.0)
    prompts = PROMPTS + ["Janet", "x"]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    engine = _fast(model, tiny_tokenizer, attention="triton")
    fast = engine.generate(prompts, params)
    assert engine.stats["compactions"] > 0
    assert _ids(fast) == _ids(_fast(model, tiny_tokenizer, attention="sdpa").generate(prompts, params))


def test_engine_sampled_logprobs_equal_teacher_forced(tiny_model, tiny_tokenizer):
    out = _fast(tiny_model, tiny_tokenizer, attention="triton").generate(
        PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7))
    assert_logprobs_are_teacher_forced(tiny_model, tiny_tokenizer, PROMPTS, out)
