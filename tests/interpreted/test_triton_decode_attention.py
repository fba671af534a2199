"""The Triton decode-attention kernel, run by Triton's CPU interpreter: it must compute what the SDPA
reference computes, alone and inside the fast engine (greedy tokens, compaction, sampled log-probs)."""

from __future__ import annotations

import pytest
import torch
from conftest import family_model, greedy_generate_reference
from test_decode_attention import per_row_softmax, random_case
from test_engines_fast import PROMPTS, _eos_prone, _fast, _ids, assert_logprobs_are_teacher_forced

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast.kernels.decode_attention import prompt_runs, reference_decode_attention, triton_decode_attention


@pytest.fixture(autouse=True)
def _interpreter_scalars(monkeypatch):
    """Works around a bug of Triton's interpreter, not of ours: in Triton 3.6.0 (the installed one) its
    ``_patch_lang_tensor`` gives a tensor ``__index__`` as ``int(self.handle.data)``, and numpy 2.4 made
    ``int()`` of an array of rank 1 a TypeError ("only 0-dimensional arrays can be converted to Python
    scalars"), so a loop bound loaded from memory (the kernel's lengths) fails. Reported as
    triton-lang/triton issue 9171, fixed on Triton's main by pull request 9172 (reading the element);
    drop this once the installed Triton has that fix. It wraps the interpreter's own function, adding
    only that ``__index__``; there is no public hook for it."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


def copy_then_reference(c, k_new, v_new, rlen, live=None):
    """What the kernel's new-token write must equal: the token's K/V copied into response slot rlen - 1
    (``index_copy_``), then the reference. Returns (reference output, written K cache, written V cache)."""
    slot = torch.tensor([rlen - 1])
    rk, rv = c["rk"].clone(), c["rv"].clone()
    rk.index_copy_(2, slot, k_new)
    rv.index_copy_(2, slot, v_new)
    ref = reference_decode_attention(
        **dict(c, rk=rk, rv=rv),
        rlen=torch.tensor([rlen]),
        live=live,
        prompt_slots=c["pk"].shape[2],
        response_slots=c["rk"].shape[2],
    )
    return ref, rk, rv


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("rlen", [1, 8, 9, 19])
def test_kernel_equals_reference(block, rlen):
    """Block sizes that split the prompt and response at different places, a response of one slot, one
    exactly a block long, and a full one."""
    for seed in range(2):
        c = random_case(seed)
        ref = reference_decode_attention(
            **c, rlen=torch.tensor([rlen]), prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2]
        )
        out = triton_decode_attention(**c, rlen=torch.tensor([rlen]), block=block)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        assert torch.allclose(out.double(), per_row_softmax(**c, rlen=rlen), atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("rlen", [1, 2, 9, 19])
def test_kernel_writing_the_new_token_equals_copy_then_reference(splits, rlen):
    """With ``k_new``/``v_new`` the kernel writes the current token's K/V to slot rlen - 1 itself and
    attends to it from registers; the result and the cache equal ``index_copy_`` then the reference,
    however the slots are split (more splits than blocks leaves some programs empty)."""
    c = random_case(5)
    g = torch.Generator().manual_seed(11)
    k_new = torch.randn(c["q"].shape, generator=g)
    v_new = torch.randn(c["q"].shape, generator=g)
    ref, rk, rv = copy_then_reference(c, k_new, v_new, rlen)
    out = triton_decode_attention(**c, rlen=torch.tensor([rlen]), k_new=k_new, v_new=v_new, splits=splits, block=4)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert torch.equal(c["rk"], rk) and torch.equal(c["rv"], rv)  # the kernel wrote the new slot, nothing else


@pytest.mark.parametrize("head_dim", [12, 48, 80, 96])
@pytest.mark.parametrize("cascade", [False, True])
def test_any_head_dim_equals_reference(head_dim, cascade):
    """head_dims that are not powers of two (the kernels run on the next power of two and mask the lanes
    beyond head_dim): the output equals the reference with the new token written, finished rows, split
    slots and cascade runs, and the write touches exactly the new slot's head_dim values (a neighbouring
    slot's first values would be overwritten by an unmasked lane; every row's slot is written, finished
    or not)."""
    c = random_case(9, groups=2, n=3, head_dim=head_dim, prompt_slots=11, response_slots=9)
    rows = c["q"].shape[0]
    g = torch.Generator().manual_seed(head_dim)
    k_new, v_new = torch.randn(c["q"].shape, generator=g), torch.randn(c["q"].shape, generator=g)
    live = torch.tensor([i != 1 for i in range(rows)], dtype=torch.int32)
    rlen = 5
    ref, rk, rv = copy_then_reference(c, k_new, v_new, rlen, live)
    runs = None
    if cascade:
        first, count = prompt_runs(c["grp"].tolist(), [bool(x) for x in live], 16)
        runs = (torch.tensor(first, dtype=torch.int32), torch.tensor(count, dtype=torch.int32))
    for splits in (1, 2):
        case = dict(c, rk=c["rk"].clone(), rv=c["rv"].clone())
        out = triton_decode_attention(
            **case,
            rlen=torch.tensor([rlen]),
            k_new=k_new,
            v_new=v_new,
            live=live,
            splits=splits,
            block=4,
            runs=runs,
            run_rows=16,
            run_block=4,
        )
        assert out.shape == ref.shape
        assert torch.allclose(out, ref, atol=1e-5), (head_dim, splits, (out - ref).abs().max())
        assert torch.equal(case["rk"], rk) and torch.equal(case["rv"], rv)


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 1), (8, 4)])
def test_grouped_query_heads_equal_reference(heads, kv_heads, splits, cascade):
    """Grouped-query attention: one program per (row, key/value head) takes all of that head's query heads
    (2, 3, 4 per key/value head). With the new token written once per key/value head, finished rows,
    split slots, cascade runs (several rows' query heads per program) and responses read through a
    cache-row index, the output equals the reference and exactly the new slot of the named cache rows
    changes."""
    c = random_case(12, heads=heads, kv_heads=kv_heads, head_dim=12)
    rows = c["q"].shape[0]
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    kv_shape = (rows, kv_heads, 1, 12)
    k_new, v_new = torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g)
    live = torch.tensor([i % 4 != 2 for i in range(rows)], dtype=torch.int32)
    where = torch.randperm(rows + 2, generator=g)[:rows]
    rlen = 6
    ref, rk, rv = copy_then_reference(c, k_new, v_new, rlen, live)
    want = per_row_softmax(**dict(c, rk=rk, rv=rv), rlen=rlen) * live[:, None, None, None]
    assert torch.allclose(ref.double(), want, atol=1e-5)
    runs = None
    if cascade:  # two rows per run: up to 2 x 4 query heads per program
        first, count = prompt_runs(c["grp"].tolist(), [bool(x) for x in live], 2)
        runs = (torch.tensor(first, dtype=torch.int32), torch.tensor(count, dtype=torch.int32))
    cache_k = torch.randn((rows + 2,) + c["rk"].shape[1:], generator=g)
    cache_v = torch.randn_like(cache_k)
    cache_k[where], cache_v[where] = c["rk"], c["rv"]
    before_k = cache_k.clone()
    out = triton_decode_attention(
        **dict(c, rk=cache_k, rv=cache_v),
        rlen=torch.tensor([rlen]),
        k_new=k_new,
        v_new=v_new,
        live=live,
        splits=splits,
        runs=runs,
        run_rows=16,
        run_block=4,
        cache_rows=where,
    )
    assert out.shape == c["q"].shape
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert torch.equal(cache_k[where], rk) and torch.equal(cache_v[where], rv)
    others = torch.ones(rows + 2, dtype=torch.bool)
    others[where] = False
    assert torch.equal(cache_k[others], before_k[others])


def test_grouped_query_heads_check_their_shapes():
    c = random_case(1, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="k_new and v_new"):
        triton_decode_attention(**c, rlen=torch.tensor([3]), k_new=c["q"], v_new=c["q"])
    with pytest.raises(ValueError, match="divisor"):
        triton_decode_attention(**random_case(1, heads=4, kv_heads=3), rlen=torch.tensor([3]))


@pytest.mark.parametrize("splits", [1, 4])
def test_finished_rows_read_nothing_and_return_zero(splits):
    """Rows whose ``live`` flag is 0 return 0; the others are untouched by their neighbours' flags."""
    c = random_case(6)
    rlen = torch.tensor([7])
    live = torch.tensor([i % 3 != 1 for i in range(c["q"].shape[0])], dtype=torch.int32)
    ref = reference_decode_attention(
        **c, rlen=rlen, prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2], live=live
    )
    c["rk"][live == 0] = float("nan")  # a finished row's response is never read
    out = triton_decode_attention(**c, rlen=rlen, live=live, splits=splits, block=8)
    assert torch.equal(out[live == 0], torch.zeros_like(out[live == 0]))
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("splits", [2, 16])
def test_split_slots_equal_one_program(splits):
    """Without the new token or flags, splitting the slots across programs changes nothing."""
    c = random_case(7)
    for rlen in (3, 19):
        one = triton_decode_attention(**c, rlen=torch.tensor([rlen]), block=4)
        split = triton_decode_attention(**c, rlen=torch.tensor([rlen]), splits=splits, block=4)
        assert torch.allclose(one, split, atol=1e-5), (one - split).abs().max()


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("most", [2, 4, 16])
def test_cascade_over_shared_prompts_equals_reference(splits, most):
    """With ``runs`` one program per (run, head) reduces a prompt's slots for all the rows of the run and
    each row merges that partial in: the result equals the per-row reference however the rows are cut
    into runs (``most`` rows at most, some runs of one row), with finished rows inside and at the ends
    of runs, padding runs of count 0, the new token written by the kernel and the slots split."""
    c = random_case(5)
    rows = c["q"].shape[0]
    flags = [i % 7 != 2 and i != rows - 1 for i in range(rows)]  # row 2 inside a run, the last row at an end
    first, count = prompt_runs(c["grp"].tolist(), flags, most)
    assert max(count) <= most and sum(count) < rows
    live = torch.tensor(flags, dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    k_new, v_new = torch.randn(c["q"].shape, generator=g), torch.randn(c["q"].shape, generator=g)
    for rlen in (1, 9):
        ref, rk, rv = copy_then_reference(c, k_new, v_new, rlen, live)
        case = dict(c, rk=c["rk"].clone(), rv=c["rv"].clone())
        case["q"] = case["q"].clone()
        case["q"][live == 0] = float("nan")  # a finished row's query is never read
        runs = (torch.tensor(first + [0, 0], dtype=torch.int32), torch.tensor(count + [0, 0], dtype=torch.int32))
        out = triton_decode_attention(
            **case,
            rlen=torch.tensor([rlen]),
            k_new=k_new,
            v_new=v_new,
            live=live,
            splits=splits,
            block=4,
            runs=runs,
            run_rows=16,
            run_block=4,
        )
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        assert torch.equal(case["rk"], rk) and torch.equal(case["rv"], rv)


def test_cascade_reads_each_prompt_through_its_run():
    """A run's program reads the prompt of the run's first row: rows sent to the wrong run get the
    wrong prompt, so the runs really carry the prompt part (the check above cannot pass by accident)."""
    c = random_case(3, groups=2, n=4)
    rows = c["q"].shape[0]
    rlen = torch.tensor([5])
    live = torch.ones(rows, dtype=torch.int32)
    right = prompt_runs(c["grp"].tolist(), [True] * rows, 16)
    ok = triton_decode_attention(
        **c, rlen=rlen, live=live, block=4, run_block=4, runs=tuple(torch.tensor(x, dtype=torch.int32) for x in right)
    )
    ref = reference_decode_attention(**c, rlen=rlen, prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2])
    assert torch.allclose(ok, ref, atol=1e-5)
    wrong = (torch.tensor([0], dtype=torch.int32), torch.tensor([rows], dtype=torch.int32))  # one run over both prompts
    bad = triton_decode_attention(**c, rlen=rlen, live=live, block=4, run_block=4, runs=wrong)
    in_second = c["grp"] == 1
    assert torch.allclose(bad[~in_second], ref[~in_second], atol=1e-5)
    assert not torch.allclose(bad[in_second], ref[in_second], atol=1e-3)


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_reads_and_writes_responses_through_cache_rows(splits, cascade):
    """With ``cache_rows`` the kernel reads batch row i's response from cache row cache_rows[i] and
    writes the new token there: the same output as the rows in order, and exactly the named cache
    rows change (at slot rlen - 1)."""
    c = random_case(9)
    rows = c["q"].shape[0]
    g = torch.Generator().manual_seed(2)
    where = torch.randperm(rows + 3, generator=g)[:rows]
    k_new, v_new = torch.randn(c["q"].shape, generator=g), torch.randn(c["q"].shape, generator=g)
    rlen = torch.tensor([6])
    runs = None
    if cascade:
        first, count = prompt_runs(c["grp"].tolist(), [True] * rows, 16)
        runs = (torch.tensor(first, dtype=torch.int32), torch.tensor(count, dtype=torch.int32))
    kw = dict(rlen=rlen, k_new=k_new, v_new=v_new, splits=splits, block=4, runs=runs, run_block=4)
    in_order = dict(c, rk=c["rk"].clone(), rv=c["rv"].clone())
    ref = triton_decode_attention(**in_order, **kw)
    rk = torch.randn((rows + 3,) + c["rk"].shape[1:], generator=g)
    rv = torch.randn_like(rk)
    rk[where], rv[where] = c["rk"], c["rv"]
    rk0, rv0 = rk.clone(), rv.clone()
    out = triton_decode_attention(**dict(c, rk=rk, rv=rv), **kw, cache_rows=where)
    assert torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
    assert torch.equal(rk[where], in_order["rk"]) and torch.equal(rv[where], in_order["rv"])
    others = torch.ones(rows + 3, dtype=torch.bool)
    others[where] = False
    assert torch.equal(rk[others], rk0[others]) and torch.equal(rv[others], rv0[others])


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
    # One program per (row, head) here and in the log-prob test (the interpreter runs programs one by one);
    # the retired-rows test splits the slots.
    fast = _fast(tiny_model, tiny_tokenizer, attention="triton", attention_splits=1).generate(PROMPTS, params)
    assert [g[0].token_ids for g in fast] == greedy_generate_reference(tiny_model, tiny_tokenizer, PROMPTS, 20)
    sdpa = _fast(tiny_model, tiny_tokenizer, attention="sdpa").generate(PROMPTS, params)
    for f, s in zip(fast, sdpa):
        assert f[0].logprobs == pytest.approx(s[0].logprobs, abs=1e-5)


def test_engine_with_retired_rows_equals_sdpa_path(tiny_model, tiny_tokenizer):
    """Rows finishing at different steps are flagged finished, then compacted; the kernel then reads
    prompts through ``grp``."""
    model = _eos_prone(tiny_model, tiny_tokenizer, boost=2.0)
    prompts = PROMPTS + ["Janet", "x"]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    engine = _fast(model, tiny_tokenizer, attention="triton", attention_splits=2)
    fast = engine.generate(prompts, params)
    assert engine.stats["compactions"] > 0
    assert _ids(fast) == _ids(_fast(model, tiny_tokenizer, attention="sdpa").generate(prompts, params))


def test_engine_sampled_logprobs_equal_teacher_forced(tiny_model, tiny_tokenizer):
    out = _fast(tiny_model, tiny_tokenizer, attention="triton", attention_splits=1).generate(
        PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7)
    )
    assert_logprobs_are_teacher_forced(tiny_model, tiny_tokenizer, PROMPTS, out)


def test_engine_with_cascade_equals_sdpa_path(tiny_model, tiny_tokenizer):
    """Cascade attention in every bucket (``cascade_min_rows=1``) while rows finish, are flagged (also in
    the middle of a run) and compacted: with the same seed, the same sampled tokens and log-probs as the
    SDPA path, and the cascade steps did run."""
    model = _eos_prone(tiny_model, tiny_tokenizer, boost=40.0)  # sampled rows end at many lengths
    prompts = PROMPTS[:3] + ["Janet", "x"]
    kw = dict(batch_buckets=(16, 12, 1), max_batch_size=15)  # one chunk: rows are flagged, then compacted
    # Which rows finish when depends on the tokenizer the fixtures built (GSM8K's text or the fallback
    # corpus): take the first seed whose sampled rows are flagged and compacted, and one of whose groups
    # ends at three lengths.
    for seed in range(3, 43):
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=14, seed=seed)
        engine = _fast(model, tiny_tokenizer, attention="triton", attention_splits=2, cascade_min_rows=1, **kw)
        steps, run_step = [], engine._run_step
        engine._run_step = lambda *a, steps=steps, run_step=run_step: (steps.append(a[1]), run_step(*a))
        fast = engine.generate(prompts, params)
        three_lengths = any(len({len(c.token_ids) for c in g}) == 3 for g in fast)
        if engine.stats["compactions"] > 0 and engine.stats["rows_flagged"] > 0 and three_lengths:
            break
    assert any(len({len(c.token_ids) for c in g}) == 3 for g in fast)  # a group's rows end at three lengths
    assert engine.stats["compactions"] > 0 and engine.stats["rows_flagged"] > 0
    assert engine.stats["cascade_steps"] == len(steps) > 10  # every step, in every bucket
    sdpa = _fast(model, tiny_tokenizer, attention="sdpa", **kw).generate(prompts, params)
    assert _ids(fast) == _ids(sdpa)
    for f, s in zip(fast, sdpa):
        for a, b in zip(f, s):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_engine_sampled_rows_keep_their_draws_when_the_batch_shrinks(tiny_model, tiny_tokenizer):
    """Counter-based noise follows the output row, not the batch row: with the same seed, a run whose
    finished rows move the live ones to the front of smaller buckets samples the same tokens and
    log-probs as a run that keeps every row in place (the SDPA path, which writes the same noise out
    where Triton runs, so that the interpreter runs only the noise kernel)."""
    prompts = PROMPTS[:3] + ["Janet", "x"]
    kw = dict(attention="sdpa", max_batch_size=15)
    # Rows capped at chosen lengths finish early whatever the tokenizer (the fixture's depends on the data
    # beside the repo), so that the shrinking run compacts for sure.
    limits = [[2, 3, 10], [2, 2, 3], [3, 10, 2], [2, 3, 2], [10, 2, 3]]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=3)
    shrinking = _fast(tiny_model, tiny_tokenizer, batch_buckets=(16, 8, 4, 1), **kw)
    out = shrinking.generate(prompts, params, row_max_new_tokens=limits)
    assert shrinking.stats["compactions"] > 0
    fixed = _fast(tiny_model, tiny_tokenizer, batch_buckets=(16,), **kw)
    kept = fixed.generate(prompts, params, row_max_new_tokens=limits)
    assert fixed.stats["compactions"] == 0
    assert _ids(out) == _ids(kept)
    for f, s in zip(out, kept):
        for a, b in zip(f, s):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_engine_allocates_its_noise_buffer_only_for_top_p(tiny_model, tiny_tokenizer):
    """Where the kernel makes its own noise the engine holds no rows x vocabulary noise buffer; top-p,
    which sorts in ``sample_math`` over written-out noise, allocates it then, and samples what the SDPA
    path samples."""
    engine = _fast(tiny_model, tiny_tokenizer, attention="triton", attention_splits=1)
    engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=1))
    assert engine._state.noise.shape[0] == 0
    top_p = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=4, seed=1)
    out = engine.generate(PROMPTS[:2], top_p)
    assert engine._state.noise.shape == (engine._state.rows_cap, tiny_model.lm_head.weight.shape[0])
    assert _ids(out) == _ids(_fast(tiny_model, tiny_tokenizer, attention="sdpa").generate(PROMPTS[:2], top_p))


def test_engine_with_odd_head_dim_equals_model_generate(tiny_tokenizer):
    """A model whose head_dim (12) is not a power of two decodes through the kernel, as the '20m' model's
    48 and Qwen-style 80 or 96 do on a GPU."""
    from rlvr.modeling import build_model, small_olmo2_config

    model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=48, num_layers=2, num_heads=4), seed=1).eval()
    assert model.config.hidden_size // model.config.num_attention_heads == 12
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    fast = _fast(model, tiny_tokenizer, attention="triton", attention_splits=1).generate(PROMPTS, params)
    assert [g[0].token_ids for g in fast] == greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 12)


def test_engine_with_grouped_query_attention_equals_reference(tiny_tokenizer):
    """Grouped-query attention through the kernel (a Llama model with 3 query heads per key/value head,
    taken together by one program per row and key/value head): greedy tokens equal
    ``model.generate``; with cascade attention in every bucket while rows finish, the sampled tokens and
    log-probs equal the SDPA path's."""
    model = family_model("llama", tiny_tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    fast = _fast(model, tiny_tokenizer, attention="triton", attention_splits=2).generate(PROMPTS[:2], greedy)
    assert [g[0].token_ids for g in fast] == greedy_generate_reference(model, tiny_tokenizer, PROMPTS[:2], 10)
    model = _eos_prone(model, tiny_tokenizer, boost=40.0)
    prompts = PROMPTS[:2] + ["x"]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=3)
    kw = dict(batch_buckets=(12, 9, 1), max_batch_size=9)
    engine = _fast(model, tiny_tokenizer, attention="triton", attention_splits=1, cascade_min_rows=1, **kw)
    out = engine.generate(prompts, params)
    assert engine.stats["cascade_steps"] > 0 and engine.stats["rows_flagged"] + engine.stats["compactions"] > 0
    sdpa = _fast(model, tiny_tokenizer, attention="sdpa", **kw).generate(prompts, params)
    assert _ids(out) == _ids(sdpa)
    for f, s in zip(out, sdpa):
        for a, b in zip(f, s):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
