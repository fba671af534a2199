"""Shared-prompt packing (``rlvr.training.packing``): the layout by hand, the planner by hand, and packed
= padded (log-probs, entropies, gradients, whole updates) for every family the fast engine runs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import family_model, padded_and_packed

from rlvr.checks import resolve_config, validate_config
from rlvr.training.logprobs import get_response_log_probs
from rlvr.training.packing import (
    _pack_to,
    attend_packed,
    attention_mask,
    pack_rows,
    packed_response_log_probs,
    shared_prefix_plan,
)
from rlvr.training.tokenize import tokenize_prompt_and_output
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

FAMILIES = ["olmo2", "llama", "qwen2", "qwen3"]


def _hand_batch():
    """Three rows, the first two with the same prompt [5, 6, 7]: full sequences [5, 6, 7, 8, 9],
    [5, 6, 7, 10] and [5, 6, 11, 12, 13] (prompt [5, 6]), as ``tokenize_prompt_and_output`` lays them out
    (inputs = sequence[:-1], labels = sequence[1:], right padding with 0)."""
    input_ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 0], [5, 6, 11, 12]])
    labels = torch.tensor([[6, 7, 8, 9], [6, 7, 10, 0], [6, 11, 12, 13]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    return input_ids, labels, mask


def test_pack_layout_by_hand():
    input_ids, _, mask = _hand_batch()
    pack = pack_rows(input_ids, mask, [0, 1, 2], 4)
    # the prompts first, each once: A [5, 6, 7] (rows 0 and 1), B [5, 6] (row 2); then the responses'
    # inputs group by group: row 0's [8] (9 is only a label), row 1's none ([10] is only a label), row 2's
    # [11, 12]
    assert pack.input_ids.tolist() == [[5, 6, 7, 5, 6, 8, 11, 12]]
    assert pack.n_tokens == 8
    assert pack.position_ids.tolist() == [[0, 1, 2, 0, 1, 3, 2, 3]]
    # segments: prompt A 0, prompt B 1, row 0's response 2, (row 1's empty response 3), row 2's 4
    assert pack.segment.tolist() == [0, 0, 0, 1, 1, 2, 4, 4]
    assert pack.prompt.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert (pack.prompt_lengths, pack.response_lengths, pack.group_lengths) == ((3, 2), (1, 0, 2), (1, 2))
    # labels 8, 9 of row 0 come from packed 2 (prompt A's end) and 5; label 10 of row 1 from 2; labels
    # 11, 12, 13 of row 2 from 4 (prompt B's end), 6 and 7
    assert pack.hidden_index.tolist() == [2, 5, 2, 4, 6, 7]
    # their places in the (3 rows, width 4) layout: row 0 columns 2, 3; row 1 column 2; row 2 columns 1-3
    assert pack.keep.tolist() == [2, 3, 6, 9, 10, 11]


def test_mask_by_hand():
    input_ids, _, mask = _hand_batch()
    m = attention_mask(pack_rows(input_ids, mask, [0, 1, 2], 4))
    assert m.shape == (8, 8)
    seen = {q: [k for k in range(8) if m[q, k]] for q in range(8)}
    assert seen[0] == [0] and seen[2] == [0, 1, 2]  # the prompt is causal
    assert seen[3] == [3] and seen[4] == [3, 4]  # prompt B does not see prompt A
    assert seen[5] == [0, 1, 2, 5]  # row 0's response: its prompt and itself
    assert seen[6] == [3, 4, 6] and seen[7] == [3, 4, 6, 7]  # row 2's: prompt B, not row 0


def test_an_empty_pack_is_one_padding_token():
    pack = pack_rows(torch.tensor([[1, 2, 3]]), torch.zeros((1, 3), dtype=torch.bool), [0], 3)
    assert pack.input_ids.tolist() == [[0]] and pack.n_tokens == 0
    assert (pack.prompt_lengths, pack.response_lengths, pack.group_lengths) == ((), (), ())


def test_two_responses_of_one_prompt_do_not_see_each_other():
    input_ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    pack = pack_rows(input_ids, mask, [0, 1], 4)
    assert pack.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 2, 3]]
    m = attention_mask(pack)
    assert [k for k in range(6) if m[4, k]] == [0, 1, 4]  # row 1's first input: the prompt, not row 0's
    assert [k for k in range(6) if m[5, k]] == [0, 1, 4, 5]


def _layout(pack):
    return _pack_to(pack, torch.zeros(1, dtype=torch.long), torch.device("cpu"))[1]


def test_three_part_attention_by_hand():
    """One prompt token and one response token, one head of size 1, scale 1: the response's query 1
    sees key 0 (the prompt, score 0) and key 2 (itself, score 2), so the softmax weights are 1 / (1 + e^2)
    and e^2 / (1 + e^2) on values 3 and 5; the merged parts give the whole softmax and its gradients."""
    input_ids = torch.tensor([[7, 8]])
    mask = torch.tensor([[1, 1]], dtype=torch.bool)  # prompt [7]; labels at both positions, one response input
    pack = pack_rows(input_ids, mask, [0], 2)
    assert pack.input_ids.tolist() == [[7, 8]] and (pack.prompt_lengths, pack.response_lengths) == ((1,), (1,))
    q = torch.tensor([[[0.0]], [[1.0]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[0.0]], [[2.0]]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[[3.0]], [[5.0]]], dtype=torch.float64, requires_grad=True)
    out = attend_packed(q, k, v, _layout(pack), 1.0, flash=False)
    e2 = math.exp(2.0)
    w_prompt, w_own = 1 / (1 + e2), e2 / (1 + e2)
    assert out[0, 0, 0].item() == pytest.approx(3.0)  # the prompt sees only itself
    assert out[1, 0, 0].item() == pytest.approx(3 * w_prompt + 5 * w_own, rel=1e-6)
    dq, dk, dv = torch.autograd.grad(out[1, 0, 0], (q, k, v))
    # d out / d v = the weights; d out / d q1 = sum_j w_j k_j (v_j - out); d out / d k_j = w_j q1 (v_j - out)
    o = 3 * w_prompt + 5 * w_own
    assert dv[:, 0, 0].tolist() == pytest.approx([w_prompt, w_own], rel=1e-6)
    assert dq[1, 0, 0].item() == pytest.approx(w_own * 2 * (5 - o), rel=1e-6)
    assert dk[:, 0, 0].tolist() == pytest.approx([w_prompt * (3 - o), w_own * (5 - o)], rel=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_three_part_attention_equals_masked_sdpa(heads, kv_heads):
    """Prompts over themselves, responses over themselves and over their group's prompt, merged by their
    log-sum-exps: the dense packed mask through SDPA, output and gradients (float64), with an empty
    response and a group whose only response is empty."""
    rows = [[5, 6, 7, 8, 3], [5, 6, 7, 0, 0], [5, 6, 11, 12, 0], [5, 6, 7, 9, 9], [4, 4, 4, 1, 0]]
    input_ids = torch.tensor(rows)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 0]], dtype=torch.bool
    )
    pack = pack_rows(input_ids, mask, range(5), 5)
    assert 0 in pack.response_lengths and 0 in pack.group_lengths
    n = pack.input_ids.shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(n, kv_heads, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = attend_packed(q, k, v, _layout(pack), 0.3, flash=False)
    reps = heads // kv_heads
    dense = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1))),
        attn_mask=attention_mask(pack),
        scale=0.3,
    ).transpose(0, 1)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(dense, (q, k, v), grad)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)  # the arithmetic path computes in float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_plan_by_hand():
    """Groups stay together; a prompt counts once per microbatch and again in the next one when a group
    is cut; the row cap also cuts; rows left out (zero advantage) are not planned."""
    prompt_a, prompt_b = [1, 2, 3, 4], [7, 8]
    rows = [prompt_a + [9] * 5, prompt_b + [9] * 3, prompt_a + [9] * 2, prompt_b + [9] * 7, prompt_a + [9] * 3]
    width = max(map(len, rows)) - 1
    input_ids = torch.zeros((5, width), dtype=torch.long)
    mask = torch.zeros((5, width), dtype=torch.bool)
    for i, seq in enumerate(rows):
        p = len(prompt_a) if seq[:4] == prompt_a else len(prompt_b)
        input_ids[i, : len(seq) - 1] = torch.tensor(seq[:-1])
        mask[i, p - 1 : len(seq) - 1] = True
    # packed inputs: a row's response minus its last token (4, 2, 1, 6, 2), each prompt once (4 and 2)
    keep = [True] * 5
    assert shared_prefix_plan(input_ids, mask, keep, 8) == [[0, 2, 4, 1, 3]]
    # a budget of 12: A (4) + 4 + 1 = 9, row 4 would make 11, then B's prompt and row 1 would make 15
    assert shared_prefix_plan(input_ids, mask, keep, 8, 12) == [[0, 2, 4], [1, 3]]
    # a budget of 10: row 4 (2) would make 11, so it starts the next microbatch with A's prompt again
    assert shared_prefix_plan(input_ids, mask, keep, 8, 10) == [[0, 2], [4, 1], [3]]
    assert shared_prefix_plan(input_ids, mask, keep, 2) == [[0, 2], [4, 1], [3]]
    assert shared_prefix_plan(input_ids, mask, [True, False, True, True, False], 8) == [[0, 2, 3]]


def test_a_batch_with_a_gap_in_a_response_is_not_packed():
    input_ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 0, 1]], dtype=torch.bool)
    assert shared_prefix_plan(input_ids, mask, [True], 4) is None
    with pytest.raises(ValueError, match="contiguous"):
        pack_rows(input_ids, mask, [0], 4)


def _group_batch(tokenizer):
    """Two prompts with three responses each (one a single token, whose only label is predicted from
    the prompt's end) and a third with two."""
    prompts = ["What is 2+3? Think first.", "Tell me about a cat that likes apples."]
    responses = [" It is 5.", " 5", " The answer is five 5 </answer>", " Once upon a time", " A cat.", " x x"]
    prompts = [p for p in prompts for _ in range(3)] + ["A third prompt?"] * 2
    responses = responses + [" yes", " no, not really"]
    return tokenize_prompt_and_output(prompts, responses, tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_log_probs_equal_padded(family, tiny_tokenizer):
    model = family_model(family, tiny_tokenizer)
    tok = _group_batch(tiny_tokenizer)
    mask = tok["response_mask"].bool()
    (padded, g_padded), (packed, g_packed) = padded_and_packed(model, tok, torch.randn(mask.shape), chunk_tokens=5)
    assert packed["backbone_tokens"] < mask.numel()
    assert packed["log_probs"].shape == padded["log_probs"].shape
    assert bool((packed["log_probs"][~mask] == 0).all())
    torch.testing.assert_close(packed["log_probs"], padded["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed["token_entropy"], padded["token_entropy"], rtol=1e-5, atol=1e-5)
    for a, b in zip(g_packed, g_padded, strict=True):  # near-zero entries differ by rounding (seen: 2.4e-6)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _old_log_probs(model, tok):
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        return get_response_log_probs(noisy, tok["input_ids"], tok["labels"])["log_probs"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "method,eps,loss_norm,budget",
    [("none", None, "sequence", None), ("grpo", 0.2, "sequence", 40), ("cispo", 0.2, "constant", 48)],
)
def test_packed_update_equals_padded(family, method, eps, loss_norm, budget, tiny_tokenizer):
    """A whole ``policy_gradient_update``: loss, gradient norm, entropy, clip fraction, importance
    statistics and the parameters after the step, with a zero advantage skipped, groups cut by the
    token budget and the row cap (two microbatches at least)."""
    model = family_model(family, tiny_tokenizer)
    tok = _group_batch(tiny_tokenizer)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.0, 0.5, -2.0, 1.5])
    old = _old_log_probs(model, tok) if method != "none" else None
    results = []
    for shared in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        spec = UpdateSpec(
            gradient_accumulation_steps=1 if budget else 2,
            max_grad_norm=1e6,
            reweighting=method,
            cliprange=eps,
            loss_normalization=loss_norm,
            normalization_constant=16.0 if loss_norm == "constant" else None,
            max_tokens_per_microbatch=budget,
            shared_prefix=shared,
        )
        batch = StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], advantages, old)
        loss, meta = policy_gradient_update(m, opt, batch, spec)
        results.append((loss, meta, [p.detach().clone() for p in m.parameters()]))
    (loss0, meta0, p0), (loss1, meta1, p1) = results
    assert meta1["n_microbatches"] >= 2 and meta1["n_sequences"] == meta0["n_sequences"] == 7
    assert meta1["backbone_tokens"] < meta0["backbone_tokens"]
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for key in ("grad_norm", "entropy", "clip_fraction"):
        if key in meta0:
            assert meta1[key] == pytest.approx(meta0[key], rel=1e-4, abs=1e-6), key
    if "importance" in meta0:
        for key, value in meta0["importance"].items():
            assert meta1["importance"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for a, b in zip(p1, p0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_kept_head_logits_leave_the_update_unchanged(shared, tiny_tokenizer):
    """``keep_head_logits`` (padded and packed, several microbatches and head chunks): the same loss and
    the same parameters after the step, bit for bit."""
    model = family_model("olmo2", tiny_tokenizer)
    tok = _group_batch(tiny_tokenizer)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.0, 0.5, -2.0, 1.5])
    results = []
    for keep in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        spec = UpdateSpec(
            gradient_accumulation_steps=1, max_grad_norm=1.0, max_tokens_per_microbatch=40, chunk_tokens=5,
            shared_prefix=shared, keep_head_logits=keep,
        )  # fmt: skip
        batch = StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], advantages)
        loss, meta = policy_gradient_update(m, opt, batch, spec)
        results.append((loss, meta, [p.detach().clone() for p in m.parameters()]))
    (loss0, meta0, p0), (loss1, meta1, p1) = results
    assert meta0["n_microbatches"] >= 2
    assert torch.equal(loss0, loss1) and meta0["grad_norm"] == meta1["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(p0, model.parameters(), strict=True))  # the step moved them


def test_packed_update_takes_a_response_with_a_gap(tiny_model, tiny_tokenizer):
    """A response with a gap (a multi-turn conversation: the environment's tokens between the model's
    turns) is packed over its whole span (tests/environments/test_environments.py checks it equals the padded path);
    ranks of a data-parallel run get a clear error."""
    tok = _group_batch(tiny_tokenizer)
    mask = tok["response_mask"].clone()
    mask[0, mask[0].nonzero()[1]] = False
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    args = (StepBatch(tok["input_ids"], tok["labels"], mask, torch.ones(8)), UpdateSpec(1, None, shared_prefix=True))
    _, meta = policy_gradient_update(tiny_model, opt, *args)
    assert meta["backbone_tokens"] < mask.numel()  # packed: each prompt once, no padding
    from rlvr.distributed import GlobalBatch

    with pytest.raises(ValueError, match="optim.shared_prefix false"):
        policy_gradient_update(tiny_model, opt, *args, global_batch=GlobalBatch(8, 1))


def test_packed_compiled_backbone_equals_eager(tiny_tokenizer):
    """``model.compile``'s layer-wise compiled backbone (inductor on the CPU) runs the packed sequence:
    the same log-probs and gradients as eager, for two packs of different lengths, compiled once."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rlvr.training.logprobs import compile_backbone

    model = family_model("qwen2", tiny_tokenizer)
    torch._dynamo.reset()
    counters.clear()
    backbone = compile_backbone(model)
    tok = _group_batch(tiny_tokenizer)
    mask = tok["response_mask"].bool()
    width = tok["input_ids"].shape[1]
    for k, rows in enumerate([[0, 1, 2, 6, 7], [3, 4, 5]]):
        results = []
        for bb in (None, backbone):
            out = packed_response_log_probs(model, tok["input_ids"], tok["labels"], mask, rows, width, 64, True, bb)
            out["log_probs"].sum().backward()
            results.append((out, [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (eager, g_eager), (comp, g_comp) = results
        torch.testing.assert_close(comp["log_probs"], eager["log_probs"], rtol=1e-4, atol=1e-5)
        for a, b in zip(g_comp, g_eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
        if k == 0:
            graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, "recompiled for a second pack length"
    torch._dynamo.reset()


def test_packing_with_gradient_checkpointing_is_a_clear_error():
    """A checkpointed layer recomputes its forward during the backward, after the pack's layout is gone."""
    from rlvr.config import ConfigError, TrainConfig

    config = TrainConfig.from_dict({"optim": {"shared_prefix": True}, "model": {"gradient_checkpointing": True}})
    with pytest.raises(ConfigError, match="optim.shared_prefix cannot recompute a packed forward"):
        validate_config(resolve_config(config))


def test_packed_attention_outside_a_packed_forward_says_what_to_do():
    from rlvr.training.packing import packed_attention

    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="set optim.shared_prefix false"):
        packed_attention(None, q, q, q, None)


@pytest.mark.parametrize("fused", [False, True])
def test_merge_by_hand(fused):
    """Shares e^0 / (e^0 + e^ln3) = 1/4 and 3/4: outputs 1 and 3 merge to 2.5 (head 0); log-sum-exp ln 4.
    Head 1 with equal log-sum-exps: the plain mean. ``fused``: the compiled weighted sum (inductor)."""
    pytest.importorskip("torch._inductor")
    from rlvr.training.packing import _merge

    own = torch.tensor([[[1.0, 10.0], [2.0, 4.0]]])  # (1 query, 2 heads, 2 dims)
    seen = torch.tensor([[[3.0, 2.0], [6.0, 0.0]]])
    lse_own = torch.tensor([[0.0], [5.0]])  # (2 heads, 1 query)
    lse_seen = torch.tensor([[math.log(3.0)], [5.0]])
    out, lse = _merge(own, seen, lse_own, lse_seen, fused=fused)
    torch.testing.assert_close(out, torch.tensor([[[2.5, 4.0], [4.0, 2.0]]]))
    torch.testing.assert_close(lse, torch.tensor([[math.log(4.0)], [5.0 + math.log(2.0)]]))
