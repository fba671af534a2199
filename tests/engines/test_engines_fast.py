"""CPU tests of the fast engine (static KV cache, bucketed batch/length, delayed host checks): it must
compute what the plain path computes. Greedy tokens equal ``HFEngine``'s and ``model.generate``'s;
stop strings and finish reasons equal ``HFEngine``'s; sampled log-probs equal a teacher-forced pass;
seeds reproduce; the ``n`` samples of a prompt differ. The CUDA-graph capture itself is exercised by
``benchmarks/bench_speed.py`` on a GPU (graph replay vs eager equality is checked there)."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_generate_reference

from rlvr.engines import make_engine
from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.hf import HFEngine, sequence_logprobs

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "How many",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much",
    "Betty is saving money for a new wallet which costs $100.",
]


def _fast(model, tok, **kw):
    # Small buckets, short length buckets and a sync every 3 steps exercise compaction, several
    # cache-length buckets and stops found late, all on a tiny model.
    opts = dict(max_batch_size=16, batch_buckets=(16, 12, 8, 4, 2, 1), length_bucket=8, sync_every=3)
    opts.update(kw)
    return FastHFEngine(model, tok, **opts)


def _ids(out):
    return [[c.token_ids for c in group] for group in out]


def assert_logprobs_are_teacher_forced(model, tok, prompts, out, atol=1e-4):
    """Every completion's sampled log-probs equal a teacher-forced pass over prompt + completion."""
    for prompt, group in zip(prompts, out):
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for c in group:
            ids = torch.tensor([p_ids + c.token_ids])
            ref = sequence_logprobs(model, ids, torch.ones_like(ids))[0, len(p_ids) - 1 :]
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=atol), (c.logprobs, ref)


def _eos_prone(model, tok, boost: float):
    """Raise the EOS logit so that greedy rows end at different lengths (exercises retiring rows)."""
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += boost * model.lm_head.weight.std()
    return model


def test_make_engine_builds_fast(tiny_model, tiny_tokenizer):
    assert isinstance(make_engine("hf-fast", tiny_model, tiny_tokenizer), FastHFEngine)


@pytest.mark.parametrize("variant", [{}, {"fused_norms": False}])
def test_greedy_equals_model_generate_and_hf_engine(tiny_model, tiny_tokenizer, variant):
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    fast = _fast(tiny_model, tiny_tokenizer, **variant).generate(PROMPTS, params)
    refs = greedy_generate_reference(tiny_model, tiny_tokenizer, PROMPTS, 30)
    hf = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16).generate(PROMPTS, params)
    assert [g[0].token_ids for g in fast] == refs
    assert _ids(fast) == _ids(hf)
    for f, h in zip(fast, hf):
        assert f[0].text == h[0].text and f[0].finish_reason == h[0].finish_reason
        assert f[0].logprobs == pytest.approx(h[0].logprobs, abs=1e-5)


def test_greedy_with_early_eos_retires_rows_and_matches_hf(tiny_model, tiny_tokenizer):
    """Rows ending at many different steps: compaction into smaller buckets must not disturb the rest."""
    model = _eos_prone(tiny_model, tiny_tokenizer, boost=2.0)
    prompts = PROMPTS * 3 + ["Janet", "A robe takes 2 bolts", "James writes a 3-page letter", "x"]
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    hf = HFEngine(model, tiny_tokenizer, max_batch_size=16).generate(prompts, params)
    lengths = {len(g[0].token_ids) for g in hf}
    assert len(lengths) > 2, "the test needs rows that finish at different steps"
    assert any(g[0].finish_reason == "stop" for g in hf)
    engines = (
        _fast(model, tiny_tokenizer),
        _fast(model, tiny_tokenizer, sync_every=1),
        _fast(model, tiny_tokenizer, sync_every=7, length_bucket=5),
    )
    for engine in engines:
        fast = engine.generate(prompts, params)
        assert _ids(fast) == _ids(hf)
        assert [g[0].finish_reason for g in fast] == [g[0].finish_reason for g in hf]
        assert [g[0].text for g in fast] == [g[0].text for g in hf]
        assert engine.stats["compactions"] > 0
    # With a check every 3 steps a row finishes while its bucket still holds 15 rows: it is flagged (its
    # attention skipped) and decodes on beside the others until the compaction.
    assert engines[0].stats["rows_flagged"] > 0


def test_ignore_eos_forces_the_length(tiny_model, tiny_tokenizer):
    model = _eos_prone(tiny_model, tiny_tokenizer, boost=2.0)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    out = _fast(model, tiny_tokenizer).generate(PROMPTS, params)
    assert all(len(g[0].token_ids) == 20 and g[0].finish_reason == "length" for g in out)
    # Forcing the length does not change the tokens before the first EOS.
    natural = _fast(model, tiny_tokenizer).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20))
    for f, n in zip(out, natural):
        assert f[0].token_ids[: len(n[0].token_ids)] == n[0].token_ids


@pytest.mark.parametrize("include", [True, False])
def test_stop_strings_and_finish_reasons_equal_hf_engine(tiny_model, tiny_tokenizer, include):
    base = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16).generate(PROMPTS, base)
    # Stop strings taken from the greedy outputs themselves, so they do occur, at different places.
    texts = [g[0].text for g in plain]
    stops = tuple({t[len(t) // 3 : len(t) // 3 + 3] for t in texts[:2] if len(t) > 12} | {texts[2][-4:-1]})
    assert stops
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop=stops, include_stop_str_in_output=include)
    hf = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16).generate(PROMPTS, params)
    assert any(g[0].finish_reason == "stop" for g in hf)
    for engine in (
        _fast(tiny_model, tiny_tokenizer),
        _fast(tiny_model, tiny_tokenizer, sync_every=1),
        _fast(tiny_model, tiny_tokenizer, sync_every=16),
    ):
        fast = engine.generate(PROMPTS, params)
        for f, h in zip(fast, hf):
            assert f[0].token_ids == h[0].token_ids
            assert f[0].text == h[0].text
            assert f[0].finish_reason == h[0].finish_reason
            assert len(f[0].logprobs) == len(f[0].token_ids)


def test_sampled_logprobs_equal_teacher_forced_recomputation(tiny_model, tiny_tokenizer):
    engine = _fast(tiny_model, tiny_tokenizer)
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=15, seed=7))
    assert_logprobs_are_teacher_forced(tiny_model, tiny_tokenizer, PROMPTS, out)


def test_logprobs_are_temperature_one_under_other_settings(tiny_model, tiny_tokenizer):
    out = _fast(tiny_model, tiny_tokenizer).generate(
        PROMPTS[:2], SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=10, seed=3)
    )
    assert_logprobs_are_teacher_forced(tiny_model, tiny_tokenizer, PROMPTS, out)


def test_n_samples_differ_and_seed_reproduces(tiny_model, tiny_tokenizer):
    engine = _fast(tiny_model, tiny_tokenizer)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=123)
    a = engine.generate(PROMPTS[:2], params)
    b = engine.generate(PROMPTS[:2], params)
    c = engine.generate(PROMPTS[:2], SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=124))
    assert [len(g) for g in a] == [4, 4]
    for group in a:
        assert len({tuple(x.token_ids) for x in group}) == 4
    assert _ids(a) == _ids(b)
    assert _ids(a) != _ids(c)


def test_tiny_top_p_is_greedy(tiny_model, tiny_tokenizer):
    """top-p below every token's mass keeps only the top token, whatever the noise."""
    engine = _fast(tiny_model, tiny_tokenizer)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    nucleus = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=12, seed=1))
    for g, group in zip(greedy, nucleus):
        assert all(c.token_ids == g[0].token_ids for c in group)


def test_sampling_distribution_matches_softmax(tiny_model, tiny_tokenizer):
    """The exponential race draws from softmax(logits / T): first-token frequencies over many samples
    match the model's next-token probabilities (total variation well under the sampling noise bound)."""
    prompt = PROMPTS[1]
    engine = _fast(tiny_model, tiny_tokenizer, max_batch_size=512, batch_buckets=(512,))
    n, temp = 512, 0.8
    out = engine.generate([prompt], SamplingParams(n=n, temperature=temp, max_new_tokens=1, seed=11))
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out[0]]), minlength=len(tiny_tokenizer)).float()
    ids = torch.tensor([tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = tiny_model(input_ids=ids).logits[0, -1, : len(tiny_tokenizer)]
    p = torch.softmax(logits / temp, dim=-1)
    tv = 0.5 * (counts / n - p).abs().sum().item()
    # E[TV] for 512 draws over this vocabulary is about 0.2-0.3; a wrong temperature or a uniform
    # draw gives well over 0.5.
    assert tv < 0.4, tv
    wrong = 0.5 * (counts / n - torch.softmax(logits, dim=-1)).abs().sum().item()
    assert tv <= wrong + 0.05


def test_chunking_and_bucket_sizes_do_not_change_greedy_outputs(tiny_model, tiny_tokenizer):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    a = _fast(tiny_model, tiny_tokenizer, max_batch_size=2, batch_buckets=(2, 1)).generate(PROMPTS, params)
    b = _fast(tiny_model, tiny_tokenizer, max_batch_size=64, batch_buckets=(64, 3), length_bucket=64).generate(
        PROMPTS, params
    )
    c = _fast(tiny_model, tiny_tokenizer, prefill_tokens=1).generate(PROMPTS, params)
    assert _ids(a) == _ids(b) == _ids(c)


def test_rejects_other_architectures(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=4)
    with pytest.raises(ValueError, match="not GPT2LMHeadModel; use engine.name: hf"):
        FastHFEngine(GPT2LMHeadModel(cfg), tiny_tokenizer)


def test_rejects_bad_settings(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="attention_splits must be a power of two"):
        FastHFEngine(tiny_model, tiny_tokenizer, attention_splits=3)
    with pytest.raises(ValueError, match="cascade_min_rows must be >= 1, or None"):
        FastHFEngine(tiny_model, tiny_tokenizer, cascade_min_rows=0)


def test_cascade_runs_only_where_it_applies(tiny_model, tiny_tokenizer, monkeypatch):
    """Cascade attention needs the Triton path, several samples per prompt and a bucket of at least
    ``cascade_min_rows`` rows; its run table is as long as the bucket's possible runs."""
    engine = FastHFEngine(tiny_model, tiny_tokenizer, attention="sdpa", cascade_min_rows=64)
    engine.attention = "triton"  # what _runs_for consults; no kernel runs here
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the Triton path resolve on the CPU
    engine._chunk_shape = (32, 8)
    assert [engine._runs_for(b) for b in (256, 128, 64, 48)] == [32, 32, 32, 0]
    engine._chunk_shape = (4, 40)  # runs of at most 32 rows: two per prompt
    assert engine._run_rows() == 32 and engine._runs_for(160) == 8
    engine._chunk_shape = (256, 1)
    assert engine._runs_for(256) == 0
    engine.cascade_min_rows = None
    engine._chunk_shape = (32, 8)
    assert engine._runs_for(256) == 0
    engine.cascade_min_rows, engine.attention = 64, "sdpa"
    assert engine._runs_for(256) == 0
    # A captured step bakes in the run table's length and the rows per run: 16 prompts x 4 and 16 x 32
    # both read 16 runs, of at most 16 and 32 rows, so they must not share a graph.
    engine.attention = "triton"
    engine._chunk_shape = (16, 4)
    four = engine._step_key(256, 512, "sample")
    engine._chunk_shape = (16, 32)
    thirty_two = engine._step_key(256, 512, "sample")
    assert four == (256, 512, "sample", 16, 16) and thirty_two == (256, 512, "sample", 16, 32)
    assert engine._step_key(32, 512, "sample") == (32, 512, "sample", 0, 0)  # below cascade_min_rows


def test_row_limits_cut_greedy_rows_where_asked(tiny_model, tiny_tokenizer):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    engine = _fast(tiny_model, tiny_tokenizer)
    full = engine.generate(PROMPTS, params)
    limits = [[3, 20], [7, 1], [12, 5], [20, 9]]
    cut = engine.generate(PROMPTS, params, row_max_new_tokens=limits)
    for f, c, lim in zip(full, cut, limits):
        for fc, cc, n in zip(f, c, lim):
            assert cc.token_ids == fc.token_ids[:n]
            assert cc.logprobs == pytest.approx(fc.logprobs[:n], abs=1e-6)
            assert cc.finish_reason == "length"
    assert engine.stats["compactions"] > 0


# --- compile_step: the decode step's pieces through torch.compile --------------------------------------


def test_compiled_pieces_serve_every_batch_size_with_head_sizes_constant():
    """A compiled piece serves every batch size from one graph, while head counts and head_dim stay
    constants of the graph that inductor's kernels specialise on: another head_dim compiles again (with
    every size symbolic, ``dynamic=True``, the same graph would take it). The values equal the eager piece."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rlvr.engines.fast import step as S

    torch._dynamo.reset()
    counters.clear()
    pre = S.compiled(S.pre_attention, "constant_head_sizes_test")
    hidden, heads, kv_heads = 32, 4, 2
    norm1 = torch.nn.Parameter(torch.rand(hidden) + 0.5)

    def call(rows: int, head_dim: int) -> None:
        g = torch.Generator().manual_seed(rows * 100 + head_dim)
        x = torch.randn(rows, 1, hidden, generator=g)
        w = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=g)
        b = torch.randn(w.shape[0], generator=g)
        cos, sin = S.rope_tables(torch.arange(rows)[:, None, None], torch.rand(head_dim // 2), 1.0, x.dtype, True)
        args = (x, norm1, (w,), (b,), None, None, cos, sin)
        kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=1e-6, pre_norm=True, qk_norm=None)
        kw |= dict(float32_scale=False, fused=True)
        for got, want in zip(pre(*args, **kw), S.pre_attention(*args, **kw)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    call(4, 8)
    call(3, 8)  # the batch size changed: it becomes symbolic
    graphs = counters["stats"]["unique_graphs"]
    call(5, 8)
    call(7, 8)
    assert counters["stats"]["unique_graphs"] == graphs
    call(5, 16)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    torch._dynamo.reset()


def test_compiled_step_equals_eager_step(tiny_model, tiny_tokenizer):
    """``compile_step=True`` (inductor on the CPU here) computes what the eager step computes: the same
    greedy tokens as ``model.generate``, the same sampled tokens for a seed (plain, temperature + top-p),
    log-probs within float32 rounding, across batch buckets that retire rows (compaction), without
    compiling again for each bucket; and after in-place weight updates."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _eos_prone(tiny_model, tiny_tokenizer, 3.0)  # rows end at different lengths: buckets shrink
    greedy = SamplingParams(temperature=0.0, max_new_tokens=25)
    compiled = _fast(model, tiny_tokenizer, compile_step=True)
    out = compiled.generate(PROMPTS, greedy)
    assert [g[0].token_ids for g in out] == greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 25)
    assert compiled.stats["compactions"] > 0
    for params in (
        SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=11),
        SamplingParams(n=2, temperature=0.7, top_p=0.8, max_new_tokens=20, seed=5),
    ):
        a = _fast(model, tiny_tokenizer, compile_step=False).generate(PROMPTS, params)
        b = compiled.generate(PROMPTS, params)
        assert _ids(a) == _ids(b)
        for ga, gb in zip(a, b):
            for ca, cb in zip(ga, gb):
                torch.testing.assert_close(torch.tensor(cb.logprobs), torch.tensor(ca.logprobs), atol=1e-5, rtol=0)
    # pre-attention and post-attention (decode steps, and the prefill's longer queries) and sampling
    # (greedy, sample, top-p), each for b > 1 and for the one-row bucket (PyTorch specialises a size of
    # 1), some twice where two sizes happen to be equal: a graph per bucket would be many more
    assert counters["stats"]["unique_graphs"] <= 12, counters["stats"]["unique_graphs"]
    # The step reads stacked copies of the q/k/v and gate/up weights (fuse_projections, on by default);
    # they follow in-place updates of the model's weights between calls, as a trainer's optimizer makes.
    assert compiled._state.wqkv and compiled._state.wgate_up
    before = [g[0].token_ids for g in out]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-2.0)
            layer.mlp.up_proj.weight.mul_(-3.0)
    after = [g[0].token_ids for g in compiled.generate(PROMPTS, greedy)]
    assert after == greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 25)
    assert after != before
    torch._dynamo.reset()


def test_compiled_step_refuses_models_it_does_not_cover(tiny_tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    config = small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    config.hidden_act = "gelu"
    model = build_model(config, seed=0)
    with pytest.raises(ValueError, match="compile_step=True does not apply.*hidden_act 'gelu'"):
        FastHFEngine(model, tiny_tokenizer, compile_step=True)
    assert FastHFEngine(model, tiny_tokenizer)._step_compiled() is False  # the default falls back quietly


def test_release_memory_frees_the_cache_and_changes_nothing(tiny_model, tiny_tokenizer):
    """``release_memory``: after every call the static cache and graphs are gone; the next call builds them
    again and samples exactly what an engine that kept them samples."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4)
    keep = _fast(tiny_model, tiny_tokenizer)
    lean = _fast(tiny_model, tiny_tokenizer, release_memory=True)
    for _ in range(2):
        a, b = keep.generate(PROMPTS, params), lean.generate(PROMPTS, params)
        assert _ids(a) == _ids(b)
        assert [[c.logprobs for c in g] for g in a] == [[c.logprobs for c in g] for g in b]
        assert keep._state is not None
        assert lean._state is None and not lean._graphs


def _shared_start(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_continuing_prefills_only_the_new_tokens_and_equals_rereading(tiny_model, tiny_tokenizer):
    """Conversations of different lengths over three turns: inside ``continuing()`` each later context is
    prefilled only past what it shares with the context before it and that context's completion (whose
    tokens but the last were fed, so their K/V exist; the engine's counts say so), and the greedy tokens
    equal, the log-probs nearly, those of an engine that reads every context whole."""
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    said = [" <tool_response>12</tool_response>", " ok. And then"]
    # A small prefill budget cuts each call's prefill into several slices of prompts.
    cached, whole = _fast(tiny_model, tiny_tokenizer, prefill_tokens=24), _fast(tiny_model, tiny_tokenizer)
    contexts, held, before = list(PROMPTS), None, []
    with cached.continuing() as store:
        for turn in range(3):
            counts = dict(cached.stats)
            out = cached.generate(contexts, params)
            ref = whole.generate(contexts, params)
            assert _ids(out) == _ids(ref)
            for a, b in zip(out, ref):
                assert torch.allclose(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-4)
            ids = [tiny_tokenizer(c, add_special_tokens=False)["input_ids"] for c in contexts]
            shared = (
                [0] * len(ids) if held is None else [min(_shared_start(i, h), len(i) - 1) for i, h in zip(ids, held)]
            )
            # beyond the previous contexts: the model's turns, where their text reads back as the same tokens
            assert turn == 0 or any(n > len(b) for n, b in zip(shared, before))
            assert cached.stats["reused_tokens"] - counts["reused_tokens"] == sum(shared)
            assert cached.stats["prefilled_tokens"] - counts["prefilled_tokens"] == sum(map(len, ids)) - sum(shared)
            held = [i + g[0].token_ids[:-1] for i, g in zip(ids, out)]
            assert store.tokens == sum(map(len, held))  # the contexts just read; those they continued are gone
            before = ids
            if turn < 2:
                contexts = [c + g[0].text + said[turn] for c, g in zip(contexts, out)]
    assert whole.stats["reused_tokens"] == 0
    assert whole.stats["prefilled_tokens"] == cached.stats["prefilled_tokens"] + cached.stats["reused_tokens"]


@pytest.mark.parametrize("chunks", [{}, {"max_batch_size": 4, "batch_buckets": (4, 2, 1)}], ids=["one", "several"])
def test_continuing_samples_that_finish_apart_and_conversations_that_end(tiny_model, tiny_tokenizer, chunks):
    """Two samples a prompt that stop at different steps (so their K/V are held in several batches, and the
    batch is compacted between), then conversations that go on while others have ended: each later call
    equals an engine reading every context whole, and once a call ends no kept block holds K/V that no
    kept context uses (the ended conversations' spans are repacked out of the blocks they shared). With a
    batch of 4 rows each call runs in chunks, whose contexts are kept and found across chunks."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_new_tokens=6)
    limits = [[3, 20], [7, 1], [12, 5], [20, 9]]
    cached, whole = _fast(tiny_model, tiny_tokenizer, sync_every=2, **chunks), _fast(tiny_model, tiny_tokenizer)

    def blocks_hold_only_what_is_used(store):
        blocks, spans = {}, set()
        for e in store.entries:
            for block, first, count in e.spans:
                blocks[id(block)] = block.tokens
                spans.add((id(block), first, count))
        return sum(blocks.values()) == sum(count for _, _, count in spans)

    with cached.continuing() as store:
        out = cached.generate(PROMPTS, params, row_max_new_tokens=limits)
        assert _ids(out) == _ids(whole.generate(PROMPTS, params, row_max_new_tokens=limits))
        assert cached.stats["compactions"] > 0
        contexts = [p + c.text + " ok." for p, g in zip(PROMPTS, out) for c in g]
        assert store.tokens == sum(
            len(tiny_tokenizer(p, add_special_tokens=False)["input_ids"]) + len(c.token_ids) - 1
            for p, g in zip(PROMPTS, out)
            for c in g
        )
        for going in ([0, 3, 4, 6, 7], [1]):  # then a conversation that waited a turn
            asked = [contexts[i] for i in going]
            before = cached.stats["reused_tokens"]
            again = cached.generate(asked, one)
            assert _ids(again) == _ids(whole.generate(asked, one))
            assert cached.stats["reused_tokens"] > before  # read from the store
            assert blocks_hold_only_what_is_used(store)
            contexts = {**dict(enumerate(contexts)), **{i: contexts[i] + g[0].text for i, g in zip(going, again)}}
            contexts = [contexts[i] for i in range(len(contexts))]


def test_prefix_store_finds_the_longest_shared_start_as_a_scan_does():
    """``find`` bisects the sorted contexts; a scan over every kept context gives the same length (and, a
    hand-made case, the same context), capped one short of the prompt."""
    from rlvr.engines.fast.prefix import PrefixStore, shared_start

    assert shared_start((1, 2, 3, 4), (1, 2, 9)) == 2
    assert shared_start((1, 2), (1, 2, 3)) == 2
    assert shared_start((5,), (1,)) == 0
    store = PrefixStore()
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 7], [9]):
        store.add(ids, [])
    assert store.find([1, 2, 3, 4, 6])[0].key == (1, 2, 3, 4, 5)
    assert store.find([1, 2, 3, 4, 6])[1] == 4
    assert store.find([1, 2, 3, 4, 5])[1] == 4  # the prompt's last token is prefilled
    assert store.find([1, 2, 7, 0])[0].key == (1, 2, 7)
    assert store.find([8, 1]) == (None, 0)
    gen = torch.Generator().manual_seed(0)
    kept = [
        torch.randint(0, 3, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(60)
    ]
    store = PrefixStore()
    for ids in kept:
        store.add(ids, [])
    for _ in range(200):
        q = torch.randint(0, 3, (int(torch.randint(1, 14, (1,), generator=gen)),), generator=gen).tolist()
        scan = max((min(shared_start(tuple(k), tuple(q)), len(q) - 1) for k in kept), default=0)
        found, n = store.find(q)
        assert n == scan
        assert found is None if n == 0 else shared_start(found.key, tuple(q)) >= n
