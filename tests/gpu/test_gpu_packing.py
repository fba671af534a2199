"""Shared-prompt packing on a GPU, where its three attentions run as FlashAttention's variable-length
kernels: the kernels against the same arithmetic written out (``_math_attention``) and against SDPA with
the packed mask written out densely, forward and backward; packed against padded log-probs and gradients
for every family (float32, the arithmetic path; bfloat16, the flash path); and ``model.compile``'s
backbone over packs of many lengths without a recompile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import family_model, padded_and_packed

from rlvr.training.logprobs import compile_backbone, get_response_log_probs
from rlvr.training.packing import (
    _pack_to,
    attend_packed,
    attention_mask,
    pack_rows,
    packed_response_log_probs,
    shared_prefix_plan,
)
from rlvr.training.tokenize import tokenize_prompt_and_output

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 128), (16, 8, 128), (12, 2, 80)])
def test_flash_parts_equal_the_arithmetic_and_the_dense_mask(dtype, heads, kv_heads, head_dim, tiny_tokenizer):
    """Output and q/k/v gradients of the flash path against the arithmetic path on the same 16-bit inputs
    and against SDPA with the dense mask in float32; the batch has a group whose responses are one
    token each (no response input) beside long ones."""
    tok = _batch(tiny_tokenizer, n_prompts=5, group=4)
    mask = tok["response_mask"].bool()
    mask[-4:] = False
    first = tok["response_mask"][-4:].int().argmax(1)
    mask[torch.arange(len(mask) - 4, len(mask)), first] = True  # the last group: one-token responses
    pack = pack_rows(tok["input_ids"], mask, list(range(mask.shape[0])), mask.shape[1])
    assert 0 in pack.group_lengths and pack.n_tokens > 500
    device = torch.device("cuda")
    _, layout, _ = _pack_to(pack, torch.zeros(1, dtype=torch.long), device)
    n = pack.input_ids.shape[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, heads, head_dim, generator=g, device=device).to(dtype).requires_grad_()
    k, v = (torch.randn(n, kv_heads, head_dim, generator=g, device=device).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(n, heads, head_dim, generator=g, device=device).to(dtype)
    scale = head_dim**-0.5
    results = []
    for flash in (True, False):
        out = attend_packed(q, k, v, layout, scale, flash=flash)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    reps = heads // kv_heads
    dense = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q32, k32.repeat_interleave(reps, 1), v32.repeat_interleave(reps, 1))),
        attn_mask=attention_mask(pack).to(device),
        scale=scale,
    ).transpose(0, 1)
    results.append((dense, *torch.autograd.grad(dense, (q32, k32, v32), grad.float())))
    (flash_out, *flash_grads), (math_out, *math_grads), (dense_out, *dense_grads) = results
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(flash_out.float(), math_out.float(), **tol)
    torch.testing.assert_close(flash_out.float(), dense_out, **tol)
    for a, b, c in zip(flash_grads, math_grads, dense_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)
        torch.testing.assert_close(a.float(), c, **tol)


FAMILY_SHAPES = {"olmo2": dict(hidden_size=64), "qwen2": dict(hidden_size=64), "llama": {}, "qwen3": {}}


@pytest.mark.parametrize("family", FAMILY_SHAPES)
def test_packed_equals_padded_on_the_gpu(family, tiny_tokenizer):
    """float32: the attentions run as the arithmetic path on the GPU; packed = padded to 1e-4."""
    model = family_model(family, tiny_tokenizer, **FAMILY_SHAPES[family]).cuda()
    tok = _batch(tiny_tokenizer, n_prompts=3, group=4, seed=1)
    mask = tok["response_mask"].bool()
    weights = torch.randn(mask.shape, device="cuda")
    (padded, g_padded), (packed, g_packed) = padded_and_packed(model, tok, weights, 256)
    torch.testing.assert_close(packed["log_probs"], padded["log_probs"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed["token_entropy"], padded["token_entropy"], rtol=1e-4, atol=1e-4)
    for a, b in zip(g_packed, g_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family", FAMILY_SHAPES)
def test_packed_bf16_flash_is_close_to_padded(family, tiny_tokenizer):
    """bfloat16 (the flash kernels, at the tiny models' head sizes): packed log-probs within bfloat16 rounding of the
    padded ones, and the weight gradients pointing the same way."""
    model = family_model(family, tiny_tokenizer, **FAMILY_SHAPES[family]).to("cuda", torch.bfloat16)
    tok = _batch(tiny_tokenizer, n_prompts=3, group=4, seed=2)
    mask = tok["response_mask"].bool()
    weights = torch.randn(mask.shape, device="cuda")
    (padded, g_padded), (packed, g_packed) = padded_and_packed(model, tok, weights, 256)
    torch.testing.assert_close(packed["log_probs"].float(), padded["log_probs"].float(), rtol=0, atol=0.1)
    flat = lambda grads: torch.cat([g.float().reshape(-1) for g in grads])  # noqa: E731
    assert F.cosine_similarity(flat(g_packed), flat(g_padded), dim=0) > 0.99


def test_compiled_backbone_runs_packs_of_any_length_without_recompiling(tiny_tokenizer):
    """bfloat16, ``model.compile``'s layer-wise backbone over the planner's packs of four batches under
    one token budget: after the first two packs, packs of new lengths compile nothing, and the log-probs
    match the eager padded ones within bfloat16 rounding."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = family_model("qwen2", tiny_tokenizer, num_layers=3, hidden_size=64).to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    backbone = compile_backbone(model)
    budget, seen, lengths = 1024, 0, set()
    for seed in range(4):
        tok = _batch(tiny_tokenizer, n_prompts=4 + 3 * seed, group=4, seed=seed, max_words=12)
        mask = tok["response_mask"].bool()
        width = mask.shape[1]
        for rows in shared_prefix_plan(tok["input_ids"], mask, [True] * mask.shape[0], 10**6, budget):
            graphs = counters["stats"]["unique_graphs"]
            out = packed_response_log_probs(
                model, tok["input_ids"], tok["labels"], mask, rows, width, 512, True, backbone
            )
            out["log_probs"].sum().backward()
            model.zero_grad(set_to_none=True)
            if seen >= 2:
                assert counters["stats"]["unique_graphs"] == graphs, (
                    f"a pack of {out['backbone_tokens']} tokens compiled"
                )
                lengths.add(out["backbone_tokens"])
            seen += 1
            with torch.no_grad():
                want = get_response_log_probs(model, tok["input_ids"][rows], tok["labels"][rows], positions=mask[rows])
            torch.testing.assert_close(out["log_probs"].detach(), want["log_probs"], rtol=0, atol=0.1)
    assert len(lengths) >= 3, f"too few lengths to check: {lengths}"
    torch._dynamo.reset()
