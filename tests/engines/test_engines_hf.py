"""CPU tests of the in-process hf engine: equivalence with ``model.generate`` (greedy), stop strings,
seeds, ``n`` distinct samples, finish reasons, and returned log-probs against a teacher-forced pass."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_generate_reference

from rlvr.engines import make_engine
from rlvr.engines.base import SamplingParams
from rlvr.engines.hf import HFEngine, sequence_logprobs
from rlvr.engines.sampling import find_stop, sample_next, truncate_at_stop

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "How many",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much",
]


def test_greedy_equals_model_generate_on_left_padded_batch(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=8)
    got = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=24))
    refs = greedy_generate_reference(tiny_model, tiny_tokenizer, PROMPTS, 24)
    assert [g[0].token_ids for g in got] == refs
    for g, ref in zip(got, refs):
        assert g[0].finish_reason == ("stop" if ref[-1] == tiny_tokenizer.eos_token_id else "length")
        assert len(g[0].token_ids) == len(g[0].logprobs)


def test_greedy_is_independent_of_batch_composition(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    batched = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], params)[0] for p in PROMPTS]
    assert [b[0].token_ids for b in batched] == [a[0].token_ids for a in alone]


def test_n_samples_differ_and_seed_reproduces(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=123)
    a = engine.generate(PROMPTS[:2], params)
    b = engine.generate(PROMPTS[:2], params)
    c = engine.generate(PROMPTS[:2], SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=124))
    assert [len(g) for g in a] == [4, 4]
    for group in a:
        assert len({tuple(x.token_ids) for x in group}) == 4
    assert [[x.token_ids for x in g] for g in a] == [[x.token_ids for x in g] for g in b]
    assert [[x.token_ids for x in g] for g in a] != [[x.token_ids for x in g] for g in c]


def test_prompt_seeds_sample_a_prompt_alone_in_its_batch_the_same_whatever_the_others(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=4)  # n=4: one prompt per decoded batch

    def sample(prompts, seeds):
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=1, prompt_seeds=seeds)
        return [[c.token_ids for c in g] for g in engine.generate(prompts, params)]

    together = sample(PROMPTS, (11, 12, 13))
    assert sample(PROMPTS[1:], (12, 13)) == together[1:]  # a data-parallel rank's share of the call
    assert sample(PROMPTS[:1], (11,)) == together[:1]
    assert sample(PROMPTS[:1], (99,)) != together[:1]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        sample(PROMPTS, (1, 2))


def test_one_sample_per_prompt_draws_from_its_own_seed_in_any_batch(tiny_model, tiny_tokenizer):
    """A multi-turn round's call (one sample per prompt, a seed each): a prompt's sample is the same
    alone, beside other prompts in one batch, or in batches cut otherwise."""

    def sample(prompts, seeds, max_batch_size):
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=10, prompt_seeds=seeds)
        out = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=max_batch_size).generate(prompts, params)
        return [g[0].token_ids for g in out]

    together = sample(PROMPTS, (11, 12, 13), 8)
    assert sample(PROMPTS, (11, 12, 13), 2) == together
    assert [sample([p], (s,), 1)[0] for p, s in zip(PROMPTS, (11, 12, 13))] == together
    assert sample(PROMPTS[:1], (99,), 8) != together[:1]


def test_chunking_keeps_prompt_alignment(tiny_model, tiny_tokenizer):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    small = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=2).generate(PROMPTS, params)
    big = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=64).generate(PROMPTS, params)
    assert [[x.token_ids for x in g] for g in small] == [[x.token_ids for x in g] for g in big]


def test_logprobs_equal_teacher_forced_recomputation(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=8)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=10, seed=5))
    for prompt, group in zip(PROMPTS, out):
        p_ids = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for comp in group:
            ids = torch.tensor([p_ids + comp.token_ids])
            lp = sequence_logprobs(tiny_model, ids, torch.ones_like(ids))[0, len(p_ids) - 1 :]
            torch.testing.assert_close(torch.tensor(comp.logprobs), lp, atol=1e-4, rtol=0)


def test_stop_string_helpers():
    assert find_stop("a </answer> b </answer>", ["</answer>"]) == (2, "</answer>")
    assert find_stop("abc", ["x"]) is None
    assert truncate_at_stop("x </answer> tail", ["</answer>"], True) == ("x </answer>", True)
    assert truncate_at_stop("x </answer> tail", ["</answer>"], False) == ("x ", True)
    assert truncate_at_stop("no stop", ["</answer>"], True) == ("no stop", False)
    # earliest occurrence over several stop strings wins
    assert truncate_at_stop("a STOP b END", ["END", "STOP"], True) == ("a STOP", True)


def test_stop_strings_end_to_end_kept_and_not_kept(tiny_model, tiny_tokenizer):
    # Find what the model produces greedily, then use a piece of that text as the stop string: the
    # engine must stop exactly there, keep or drop the stop string, and report "stop".
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=8)
    free = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30))
    texts = [g[0].text for g in free]
    target = max(range(len(texts)), key=lambda i: len(texts[i]))
    full = texts[target]
    assert len(full) >= 8, "the tiny model should produce some text"
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    kept = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30, stop=(stop,)))
    dropped = engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30, stop=(stop,), include_stop_str_in_output=False)
    )
    for i, text in enumerate(texts):
        hit = text.find(stop)
        k, d = kept[i][0], dropped[i][0]
        if hit < 0:
            assert k.text == text and k.finish_reason == free[i][0].finish_reason
            continue
        assert k.text == text[: hit + len(stop)] and k.text.endswith(stop)
        assert d.text == text[:hit]
        assert k.finish_reason == d.finish_reason == "stop"
        # tokens stop at the one that completed the stop string: a prefix of the free run
        assert k.token_ids == free[i][0].token_ids[: len(k.token_ids)]
        assert stop in tiny_tokenizer.decode(k.token_ids)
        assert stop not in tiny_tokenizer.decode(k.token_ids[:-1])
        assert len(k.logprobs) == len(k.token_ids)
    assert kept[target][0].finish_reason == "stop"


def _forcing(model, token_id):
    """Patch ``model.forward`` so that ``token_id`` dominates every next-token distribution."""
    orig = model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.logits[..., token_id] += 1e4
        return out

    model.forward = forward
    return lambda: setattr(model, "forward", orig)


def test_eos_stops_with_reason_stop(tiny_model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    undo = _forcing(tiny_model, eos)
    try:
        out = HFEngine(tiny_model, tiny_tokenizer).generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=5, seed=0))
    finally:
        undo()
    for group in out:
        for c in group:
            assert c.token_ids == [eos] and c.finish_reason == "stop" and c.text == ""
            assert c.logprobs[0] == pytest.approx(0.0, abs=1e-5)


def test_length_reason_when_max_new_tokens_reached(tiny_model, tiny_tokenizer):
    a = tiny_tokenizer("a", add_special_tokens=False)["input_ids"][0]
    undo = _forcing(tiny_model, a)
    try:
        out = HFEngine(tiny_model, tiny_tokenizer).generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    finally:
        undo()
    for group in out:
        assert group[0].token_ids == [a, a, a] and group[0].finish_reason == "length" and group[0].text == "aaa"


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, 0.7, g)[0].item() for _ in range(200)}
    assert draws == {0, 1}
    draws = {sample_next(logits, 1.0, 0.5, g)[0].item() for _ in range(50)}
    assert draws == {0}


def test_unused_vocab_is_never_sampled():
    logits = torch.zeros(4, 10)
    logits[:, 8:] = 50.0  # ids 8, 9 are beyond a tokenizer of 8 tokens
    tokens, lp = sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(0), vocab_limit=8)
    assert (tokens < 8).all()
    # log-probs stay those of the full distribution (what the trainer computes)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[0, 0].expand(4))


def test_make_engine_hf_shares_weights(tiny_model, tiny_tokenizer):
    engine = make_engine("hf", tiny_model, tiny_tokenizer)
    assert engine.model is tiny_model
    assert engine.sync_weights(tiny_model) == {"time/sync": 0.0}
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("nope", tiny_model, tiny_tokenizer)


def test_stop_candidate_filter_changes_nothing(tiny_model, tiny_tokenizer):
    # Sampled runs with several stop strings: checking only rows whose newest token holds a stop
    # string's last character must give exactly what checking every row gives.
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=25, stop=("e ", "th", "</answer>"), seed=3)
    filtered = engine.generate(PROMPTS, params)
    cands = engine.stop_candidates(params.stop)
    assert cands and all(any(c in tiny_tokenizer.decode([i]) for c in " h>") for i in cands)
    every_row = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16, filter_stop_checks=False)
    assert every_row.stop_candidates(params.stop) is None
    unfiltered = every_row.generate(PROMPTS, params)
    flat = lambda res: [(c.text, c.token_ids, c.finish_reason) for g in res for c in g]  # noqa: E731
    assert flat(filtered) == flat(unfiltered)
    assert any(c.finish_reason == "stop" for g in filtered for c in g)
