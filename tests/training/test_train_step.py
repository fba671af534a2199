"""Tokenisation, chunked log-probs, and the train step's equivalences on a real (tiny) Olmo2 model:
accumulated = full batch for both normalisations and every reweighting method; pruned = unpruned."""

import copy
import json

import pytest
import torch

from rlvr import (
    aggregate_loss_across_microbatch,
    compute_group_normalized_rewards,
    compute_policy_gradient_loss,
    get_response_log_probs,
    grpo_train_step,
    tokenize_prompt_and_output,
)
from rlvr.grpo import compute_rollout_rewards
from rlvr.training.logprobs import compile_backbone
from rlvr.training.tokenize import tokenize_from_ids
from rlvr.training.train_step import StepBatch, UpdateSpec, microbatch_plan, policy_gradient_update

# --- tokenisation -----------------------------------------------------------------------------------


def test_tokenize_prompt_and_output_layout(tiny_tokenizer):
    tok = tiny_tokenizer
    prompts, outputs = ["Hello there", "A much longer prompt here"], ["world </answer>", "x"]
    out = tokenize_prompt_and_output(prompts, outputs, tok)
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    o_ids = [tok(o, add_special_tokens=False)["input_ids"] for o in outputs]
    width = max(len(p) + len(o) for p, o in zip(p_ids, o_ids))
    for i in range(2):
        full = p_ids[i] + o_ids[i] + [tok.pad_token_id] * (width - len(p_ids[i]) - len(o_ids[i]))
        assert out["input_ids"][i].tolist() == full[:-1]
        assert out["labels"][i].tolist() == full[1:]
        expected_mask = [len(p_ids[i]) - 1 <= t < len(p_ids[i]) + len(o_ids[i]) - 1 for t in range(width - 1)]
        assert out["response_mask"][i].tolist() == expected_mask
        # the final response token is a label inside the mask; prompt and padding are outside
        last = len(p_ids[i]) + len(o_ids[i]) - 2
        assert out["response_mask"][i, last] and out["labels"][i, last] == o_ids[i][-1]
    assert out["response_mask"].dtype == torch.bool


def test_tokenize_from_ids_by_hand():
    """Rows of different prompt and output lengths, an empty output and an empty prompt, laid out by hand."""
    out = tokenize_from_ids([[1, 2], [3], [], [4, 5]], [[6], [7, 8, 9], [10, 11], []], pad_id=0)
    padded = [[1, 2, 6, 0], [3, 7, 8, 9], [10, 11, 0, 0], [4, 5, 0, 0]]
    assert out["input_ids"].tolist() == [r[:-1] for r in padded]
    assert out["labels"].tolist() == [r[1:] for r in padded]
    assert out["response_mask"].tolist() == [
        [False, True, False],
        [True, True, True],
        [True, False, False],
        [False, False, False],
    ]
    with pytest.raises(ValueError, match="shorter than 2"):
        tokenize_from_ids([[1]], [[]], pad_id=0)


def test_tokenize_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match="output_strs"):
        tokenize_prompt_and_output(["a", "b"], ["c"], tiny_tokenizer)


# --- log-probs --------------------------------------------------------------------------------------


def _naive(model, input_ids, labels):
    logits = model(input_ids).logits.float()
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


@pytest.mark.parametrize("chunk_tokens", [3, 2048])
def test_log_probs_and_entropy_match_naive(tiny_model, tiny_tokenizer, chunk_tokens):
    tok = tokenize_prompt_and_output(["What is 2+3?", "Say hi"], [" It is 5.", " hi hi hi"], tiny_tokenizer)
    out = get_response_log_probs(tiny_model, tok["input_ids"], tok["labels"], True, chunk_tokens=chunk_tokens)
    lp, ent = _naive(tiny_model, tok["input_ids"], tok["labels"])
    torch.testing.assert_close(out["log_probs"], lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["token_entropy"], ent, rtol=1e-5, atol=1e-5)
    assert torch.all(out["log_probs"] <= 0)


def test_chunked_log_prob_gradient_matches_naive(tiny_model, tiny_tokenizer):
    tok = tokenize_prompt_and_output(["What is 2+3?", "Say hi"], [" It is 5.", " hi hi hi"], tiny_tokenizer)
    w = torch.randn(tok["labels"].shape)
    get_response_log_probs(tiny_model, tok["input_ids"], tok["labels"], chunk_tokens=4)["log_probs"].mul(
        w
    ).sum().backward()
    chunked = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    _naive(tiny_model, tok["input_ids"], tok["labels"])[0].mul(w).sum().backward()
    for n, p in tiny_model.named_parameters():
        torch.testing.assert_close(chunked[n], p.grad, rtol=1e-4, atol=1e-6)


# --- train step -------------------------------------------------------------------------------------


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient as it was when ``step`` was called."""

    def __init__(self, params, lr=0.0):
        super().__init__(params, lr=lr)
        self.recorded = None
        self.steps = 0

    def step(self, closure=None):
        self.recorded = [p.grad.clone() if p.grad is not None else None for g in self.param_groups for p in g["params"]]
        self.steps += 1
        return super().step(closure)


def _reward_fn(response, ground_truth):
    r = float(ground_truth in response)
    return {"format_reward": 1.0, "answer_reward": r, "reward": r}


def _rollouts(gsm8k_path, group_size=4, n_prompts=3):
    rows = [json.loads(l) for l in open(gsm8k_path / "test.jsonl").readlines()[:n_prompts]]
    prompts = [r["question"][:60] for r in rows for _ in range(group_size)]
    truths = ["7"] * len(prompts)
    # group 0: mixed rewards; group 1: all wrong (zero advantage); group 2: mixed, different lengths
    responses = [
        " 7 apples",
        " six",
        " 7",
        " the answer is eight eight",
        " no",
        " none here",
        " nope",
        " zero",
        " maybe 7 or so and more words",
        " 1",
        " 2 2",
        " 7",
    ][: len(prompts)]
    return prompts, responses, truths


def _reference_grads(
    model, tokenizer, prompts, responses, truths, group_size, baseline, normalizer, method, old, eps, loss_norm, const
):
    rewards, _ = compute_rollout_rewards(_reward_fn, responses, truths)
    adv, _ = compute_group_normalized_rewards(rewards, group_size, baseline, 1e-6, normalizer)
    tok = tokenize_prompt_and_output(prompts, responses, tokenizer)
    lp = get_response_log_probs(model, tok["input_ids"], tok["labels"])["log_probs"]
    per_tok, _ = compute_policy_gradient_loss(adv, lp, method, old, eps, tok["response_mask"])
    loss = aggregate_loss_across_microbatch(per_tok, tok["response_mask"], loss_norm, const)
    model.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _old_log_probs(model, tokenizer, prompts, responses):
    """Log-probs of a perturbed copy of the model (so ratios differ from 1 and clipping happens),
    padded with 3 extra columns to check that T' > T is cut."""
    old_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in old_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        tok = tokenize_prompt_and_output(prompts, responses, tokenizer)
        lp = get_response_log_probs(old_model, tok["input_ids"], tok["labels"])["log_probs"]
    return torch.cat([lp, torch.full((lp.shape[0], 3), -1.0)], dim=1)


@pytest.mark.parametrize(
    "method,eps", [("none", None), ("noclip", None), ("grpo", 0.2), ("gspo", 0.05), ("cispo", 0.2)]
)
@pytest.mark.parametrize("loss_norm,baseline,normalizer", [("sequence", "mean", "std"), ("constant", "mean", "mean")])
def test_accumulated_gradient_equals_full_batch(
    tiny_model, tiny_tokenizer, gsm8k_path, method, eps, loss_norm, baseline, normalizer
):
    prompts, responses, truths = _rollouts(gsm8k_path)
    const = 12 * 16.0 if loss_norm == "constant" else None
    old = _old_log_probs(tiny_model, tiny_tokenizer, prompts, responses) if method != "none" else None
    ref_loss, ref_grads = _reference_grads(
        tiny_model,
        tiny_tokenizer,
        prompts,
        responses,
        truths,
        4,
        baseline,
        normalizer,
        method,
        old[:, :-3] if old is not None else None,
        eps,
        loss_norm,
        const,
    )
    opt = RecordingSGD(tiny_model.parameters())
    loss, meta = grpo_train_step(
        tiny_model,
        tiny_tokenizer,
        opt,
        4,
        1e9,
        _reward_fn,
        prompts,
        responses,
        truths,
        4,
        baseline=baseline,
        advantage_normalizer=normalizer,
        importance_reweighting_method=method,
        old_log_probs=old,
        cliprange=eps,
        loss_normalization=loss_norm,
        normalization_constant=const,
    )
    assert opt.steps == 1
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    for got, want in zip(opt.recorded, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in tiny_model.parameters())
    ref_norm = torch.stack([g.norm() for g in ref_grads]).norm().item()
    assert meta["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert meta["n_sequences"] == 8  # the all-wrong group was never passed through the model
    assert meta["zero_adv_frac"] == pytest.approx(1 / 3)
    if method in ("grpo", "gspo", "cispo"):
        assert 0.0 <= meta["clip_fraction"] <= 1.0
        assert "clip_fraction" in meta


@pytest.mark.parametrize("method,eps", [("noclip", None), ("ppo_clip", 0.2), ("gspo", 0.05), ("cispo", 0.2)])
def test_old_log_probs_outside_the_response_are_ignored(tiny_model, tiny_tokenizer, gsm8k_path, method, eps):
    """The update computes log-probs only at response tokens (0 elsewhere): old log-probs of any size
    at prompt and padding positions, even ones whose ratio would overflow, change nothing."""
    prompts, responses, truths = _rollouts(gsm8k_path)
    rewards, _ = compute_rollout_rewards(_reward_fn, responses, truths)
    adv, _ = compute_group_normalized_rewards(rewards, 4)
    tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    old = _old_log_probs(tiny_model, tiny_tokenizer, prompts, responses)[:, :-3]
    extreme = old.masked_fill(~tok["response_mask"], -1e4)
    results = []
    for o in (old, extreme):
        opt = RecordingSGD(tiny_model.parameters())
        batch = StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], adv, o)
        loss, meta = policy_gradient_update(tiny_model, opt, batch, UpdateSpec(3, 1e9, method, eps))
        results.append((loss, opt.recorded, meta))
    (l1, g1, m1), (l2, g2, m2) = results
    assert torch.isfinite(l2) and not m2["skipped_nonfinite"]
    torch.testing.assert_close(l1, l2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert m1["importance"] == m2["importance"]


@pytest.mark.parametrize("loss_norm", ["sequence", "constant"])
def test_pruned_equals_unpruned(tiny_model, tiny_tokenizer, gsm8k_path, loss_norm):
    prompts, responses, truths = _rollouts(gsm8k_path)
    rewards, _ = compute_rollout_rewards(_reward_fn, responses, truths)
    adv, _ = compute_group_normalized_rewards(rewards, 4)
    assert (adv == 0).sum() >= 4
    tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    results = []
    for skip in (True, False):
        opt = RecordingSGD(tiny_model.parameters())
        loss, meta = policy_gradient_update(
            tiny_model,
            opt,
            StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], adv),
            UpdateSpec(3, 1e9, loss_normalization=loss_norm, normalization_constant=100.0, skip_zero_advantage=skip),
        )
        results.append((loss, opt.recorded, meta))
    (l1, g1, m1), (l2, g2, m2) = results
    assert m1["n_sequences"] < m2["n_sequences"] == 12
    torch.testing.assert_close(l1, l2)
    for a, b in zip(g1, g2):  # float32 sums in another order (other microbatches, other head chunks)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_rft_drops_every_incorrect_rollout(tiny_model, tiny_tokenizer, gsm8k_path):
    prompts, responses, truths = _rollouts(gsm8k_path)
    opt = RecordingSGD(tiny_model.parameters())
    _, meta = grpo_train_step(
        tiny_model,
        tiny_tokenizer,
        opt,
        2,
        1.0,
        _reward_fn,
        prompts,
        responses,
        truths,
        4,
        baseline="none",
        advantage_normalizer="none",
        loss_normalization="constant",
        normalization_constant=100.0,
    )
    n_correct = sum(_reward_fn(r, t)["reward"] for r, t in zip(responses, truths))
    assert meta["n_sequences"] == n_correct


def test_grad_norm_is_clipped_and_reported_before_clipping(tiny_model, tiny_tokenizer, gsm8k_path):
    prompts, responses, truths = _rollouts(gsm8k_path)
    opt = RecordingSGD(tiny_model.parameters())
    _, meta = grpo_train_step(tiny_model, tiny_tokenizer, opt, 1, 1e-3, _reward_fn, prompts, responses, truths, 4)
    clipped_norm = torch.stack([g.norm() for g in opt.recorded if g is not None]).norm().item()
    assert meta["grad_norm"] > 1e-3
    assert clipped_norm == pytest.approx(1e-3, rel=1e-3)


def test_non_finite_loss_skips_the_update(tiny_model, tiny_tokenizer, gsm8k_path):
    prompts, responses, truths = _rollouts(gsm8k_path)
    tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    adv = torch.ones(12)
    adv[0] = float("nan")
    batch = StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], adv)
    _, meta = policy_gradient_update(tiny_model, opt, batch, UpdateSpec(2, 1.0))
    assert meta["skipped_nonfinite"]
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    assert all(p.grad is None for p in tiny_model.parameters())


def test_one_step_lowers_the_loss_of_rewarded_responses(tiny_model, tiny_tokenizer, gsm8k_path):
    """A sanity check with teeth: after a step, the advantage-weighted loss on the same batch drops."""
    prompts, responses, truths = _rollouts(gsm8k_path)
    # small enough a step that the first-order decrease shows on any tokenizer (a larger one overshot)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    l1, _ = grpo_train_step(tiny_model, tiny_tokenizer, opt, 2, None, _reward_fn, prompts, responses, truths, 4)
    rewards, _ = compute_rollout_rewards(_reward_fn, responses, truths)
    adv, _ = compute_group_normalized_rewards(rewards, 4)
    tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    with torch.no_grad():
        lp = get_response_log_probs(tiny_model, tok["input_ids"], tok["labels"])["log_probs"]
        per_tok, _ = compute_policy_gradient_loss(adv, lp)
        after = aggregate_loss_across_microbatch(per_tok, tok["response_mask"])
    assert after < l1


def test_train_step_argument_errors(tiny_model, tiny_tokenizer, gsm8k_path):
    prompts, responses, truths = _rollouts(gsm8k_path)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="group_size"):
        grpo_train_step(tiny_model, tiny_tokenizer, opt, 1, 1.0, _reward_fn, prompts, responses, truths, 5)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        grpo_train_step(tiny_model, tiny_tokenizer, opt, 5, 1.0, _reward_fn, prompts, responses, truths, 4)
    with pytest.raises(ValueError, match="old_log_probs"):
        grpo_train_step(
            tiny_model,
            tiny_tokenizer,
            opt,
            1,
            1.0,
            _reward_fn,
            prompts,
            responses,
            truths,
            4,
            importance_reweighting_method="grpo",
            cliprange=0.2,
        )
    with pytest.raises(ValueError, match="cliprange"):
        grpo_train_step(
            tiny_model,
            tiny_tokenizer,
            opt,
            1,
            1.0,
            _reward_fn,
            prompts,
            responses,
            truths,
            4,
            importance_reweighting_method="grpo",
            old_log_probs=torch.zeros(12, 100),
        )
    with pytest.raises(ValueError, match="normalization_constant"):
        grpo_train_step(
            tiny_model,
            tiny_tokenizer,
            opt,
            1,
            1.0,
            _reward_fn,
            prompts,
            responses,
            truths,
            4,
            loss_normalization="constant",
        )


# --- token-budget microbatches and the compiled backbone ---------------------------------------------


def test_microbatch_plan_token_budget_by_hand():
    # lengths 10, 3, 7, 2, 9; row 1 is skipped. Longest first: rows 0 (10), 4 (9), 2 (7), 3 (2).
    # Budget 20 padded tokens: [0] alone would pad to 10 per row, adding row 4 makes 2 x 10 = 20 (fits),
    # adding row 2 would make 3 x 10 = 30 > 20 -> cut; [2, 3]: 2 x 7 = 14 fits.
    keep = [True, False, True, True, True]
    assert microbatch_plan([10, 3, 7, 2, 9], keep, 8, 20) == [[0, 4], [2, 3]]
    # the row cap still applies under the token budget
    assert microbatch_plan([10, 3, 7, 2, 9], keep, 1, 20) == [[0], [4], [2], [3]]
    # no budget: rows only
    assert microbatch_plan([10, 3, 7, 2, 9], keep, 8) == [[0, 4, 2, 3]]
    # a row longer than the budget still gets a microbatch of its own
    assert microbatch_plan([50, 3], [True, True], 8, 20) == [[0], [1]]


@pytest.mark.parametrize("loss_norm", ["sequence", "constant"])
@pytest.mark.parametrize("method,eps", [("none", None), ("grpo", 0.2), ("gspo", 0.05)])
def test_token_budget_gradient_equals_full_batch(tiny_model, tiny_tokenizer, gsm8k_path, loss_norm, method, eps):
    prompts, responses, truths = _rollouts(gsm8k_path)
    const = 12 * 16.0 if loss_norm == "constant" else None
    old = _old_log_probs(tiny_model, tiny_tokenizer, prompts, responses) if method != "none" else None
    ref_loss, ref_grads = _reference_grads(
        tiny_model,
        tiny_tokenizer,
        prompts,
        responses,
        truths,
        4,
        "mean",
        "std",
        method,
        old[:, :-3] if old is not None else None,
        eps,
        loss_norm,
        const,
    )
    rewards, _ = compute_rollout_rewards(_reward_fn, responses, truths)
    adv, _ = compute_group_normalized_rewards(rewards, 4)
    tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    longest = int((tok["response_mask"].long().cumsum(1).argmax(1) + 1).max())
    opt = RecordingSGD(tiny_model.parameters())
    loss, meta = policy_gradient_update(
        tiny_model,
        opt,
        StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], adv, old),
        UpdateSpec(1, 1e9, method, eps, loss_norm, const, max_tokens_per_microbatch=2 * longest),
    )
    assert meta["n_microbatches"] >= 4  # 8 kept rows, at most 2 of the longest per microbatch
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    for got, want in zip(opt.recorded, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_compiled_backbone_matches_eager(tiny_model, tiny_tokenizer):
    """``model.compile``'s path (one compiled decoder-layer forward for every layer, inductor on the CPU
    here): the same log-probs and the same gradients as the eager model, for three microbatch shapes,
    one of them a single row, compiled once (dynamic shapes; a recompile would add a graph)."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backbone = compile_backbone(tiny_model)
    shapes = [
        (["What is 2+3?", "Say hi"], [" It is 5.", " hi hi hi"]),
        (["A longer question about apples and pears?", "Q", "Why?"], [" 7", " it is 12 and more", " no"]),
        (["One row alone?"], [" yes, one row"]),
    ]
    for k, (prompts, responses) in enumerate(shapes):
        tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
        w = torch.randn(tok["labels"].shape)
        results = []
        for bb in (None, backbone):
            out = get_response_log_probs(tiny_model, tok["input_ids"], tok["labels"], True, backbone=bb)
            out["log_probs"].mul(w).sum().backward()
            results.append((out, [p.grad.clone() for p in tiny_model.parameters()]))
            tiny_model.zero_grad(set_to_none=True)
        (eager, g_eager), (comp, g_comp) = results
        assert comp["log_probs"].shape == eager["log_probs"].shape
        torch.testing.assert_close(comp["log_probs"], eager["log_probs"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(comp["token_entropy"], eager["token_entropy"], rtol=1e-4, atol=1e-5)
        for a, b in zip(g_comp, g_eager):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
        if k == 0:
            graphs = counters["stats"]["unique_graphs"]
            # one decoder-layer graph shared by both layers, plus the fused log-prob's float32 parts
            assert graphs <= 3, f"{graphs} graphs for one shape: the layers did not share one compiled forward"
        assert counters["stats"]["unique_graphs"] == graphs, f"recompiled for shape {tuple(tok['input_ids'].shape)}"
    torch._dynamo.reset()


def test_compile_backbone_refuses_models_without_a_plain_head():
    class Wrapped(torch.nn.Module):
        config = None

    with pytest.raises(ValueError, match="model.compile"):
        compile_backbone(Wrapped())
