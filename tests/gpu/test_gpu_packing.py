"""Shared-prompt packing on a GPU, where its mask is a FlexAttention ``BlockMask``: FlexAttention
against SDPA with the same mask written out densely, packed against padded log-probs and gradients for
every family (float32), with packs padded to the token budget and not, and ``model.compile``'s
backbone over packs of many lengths without a recompile (bfloat16)."""

from __future__ import annotations

import pytest
import torch
from conftest import family_model, padded_and_packed

import rlvr.grpo.packing as packing
from rlvr.grpo import compile_backbone, get_response_log_probs, tokenize_prompt_and_output
from rlvr.grpo.packing import (
    FLEX_BLOCK,
    attention_mask,
    pack_rows,
    packed_attention,
    packed_response_log_probs,
    shared_prefix_plan,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _batch(tokenizer, n_prompts: int, group: int, seed: int = 0, max_words: int = 90):
    """``n_prompts`` prompts of different lengths with ``group`` responses of different lengths each
    (up to ``max_words`` words)."""
    g = torch.Generator().manual_seed(seed)
    words = ["apples", "pears", "seven", "the", "answer", "is", "cat", "runs", "and", "12", "+", "="]
    pick = lambda n: " ".join(words[int(i)] for i in torch.randint(len(words), (n,), generator=g))  # noqa: E731
    prompts, responses = [], []
    for _ in range(n_prompts):
        prompt = "Question: " + pick(int(torch.randint(5, 60, (1,), generator=g)))
        for _ in range(group):
            prompts.append(prompt)
            responses.append(" " + pick(int(torch.randint(1, max_words, (1,), generator=g))))
    return tokenize_prompt_and_output(prompts, responses, tokenizer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_flex_block_mask_equals_dense_mask(dtype, heads, kv_heads, tiny_tokenizer):
    tok = _batch(tiny_tokenizer, n_prompts=5, group=4)
    mask = tok["response_mask"].bool()
    pack = pack_rows(tok["input_ids"], mask, list(range(mask.shape[0])), mask.shape[1], FLEX_BLOCK)
    n = pack.input_ids.shape[1]
    assert n % FLEX_BLOCK == 0 and pack.n_tokens > FLEX_BLOCK
    device = torch.device("cuda")
    block = attention_mask(pack, device)
    dense = attention_mask(pack, torch.device("cpu")).to(device)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, n, 64, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, n, 64, generator=g, device=device, dtype=dtype) for _ in range(2))
    flex, _ = packed_attention(None, q, k, v, block, scaling=0.125)
    sdpa, _ = packed_attention(None, q, k, v, dense, scaling=0.125)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(flex, sdpa, **tol)


# head sizes FlexAttention takes (at least 16); the smallest test models' 8 take the dense mask
FLEX_SHAPES = {
    "olmo2": dict(hidden_size=64),
    "qwen2": dict(hidden_size=64),
    "llama": {},
    "qwen3": {},
    "olmo2-dense": {},
}


@pytest.mark.parametrize(
    "family,full", [(family, False) for family in FLEX_SHAPES] + [("llama", True)], ids=lambda value: str(value)
)
def test_packed_equals_padded_on_the_gpu(family, full, tiny_tokenizer):
    """``full``: the token budget is the pack's size, so the pack is padded to it and runs the
    FlexAttention compiled for that length (grouped-query heads)."""
    model = family_model(family.removesuffix("-dense"), tiny_tokenizer, **FLEX_SHAPES[family]).cuda()
    tok = _batch(tiny_tokenizer, n_prompts=3, group=4, seed=1)
    mask = tok["response_mask"].bool()
    budget = pack_rows(tok["input_ids"], mask, list(range(mask.shape[0])), mask.shape[1]).n_tokens if full else None
    weights = torch.randn(mask.shape, device="cuda")
    (padded, g_padded), (packed, g_packed) = padded_and_packed(model, tok, weights, 256, budget)
    if full:
        assert packed["backbone_tokens"] == -(-budget // FLEX_BLOCK) * FLEX_BLOCK
    torch.testing.assert_close(packed["log_probs"], padded["log_probs"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed["token_entropy"], padded["token_entropy"], rtol=1e-4, atol=1e-4)
    for a, b in zip(g_packed, g_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_compiled_backbone_runs_packs_of_any_length_without_recompiling(tiny_tokenizer):
    """bfloat16, ``model.compile``'s layer-wise backbone over the planner's packs of six batches under
    one token budget: once a full pack and two others have run, packs of new lengths compile nothing
    (FlexAttention at the budget's length and at symbolic lengths, the block mask, the decoder layers),
    and the log-probs match the eager padded ones within bfloat16 rounding."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = family_model("qwen2", tiny_tokenizer, num_layers=3, hidden_size=64).to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    packing._compiled_flex.clear()
    counters.clear()
    backbone = compile_backbone(model)
    budget = 1024
    full, other, late_lengths = 0, 0, set()
    for seed in range(6):
        tok = _batch(tiny_tokenizer, n_prompts=4 + 3 * seed, group=4, seed=seed, max_words=12)
        mask = tok["response_mask"].bool()
        width = mask.shape[1]
        for rows in shared_prefix_plan(tok["input_ids"], mask, [True] * mask.shape[0], 10**6, budget):
            length = pack_rows(tok["input_ids"], mask, rows, width, FLEX_BLOCK, budget).input_ids.shape[1]
            warm = full >= 1 and other >= 2
            graphs = counters["stats"]["unique_graphs"]
            out = packed_response_log_probs(
                model, tok["input_ids"], tok["labels"], mask, rows, width, 512, True, backbone, budget
            )
            out["log_probs"].sum().backward()
            model.zero_grad(set_to_none=True)
            if warm:
                assert counters["stats"]["unique_graphs"] == graphs, f"a pack of length {length} compiled"
                late_lengths.add(length)
            full, other = full + (length == budget), other + (length != budget)
            with torch.no_grad():
                want = get_response_log_probs(model, tok["input_ids"][rows], tok["labels"][rows], positions=mask[rows])[
                    "log_probs"
                ]
            torch.testing.assert_close(out["log_probs"].detach(), want, rtol=0, atol=0.1)
    assert full >= 2 and len(late_lengths - {budget}) >= 2, f"too few lengths to check: {full} full, {late_lengths}"
    torch._dynamo.reset()
