"""hf-fast on a GPU: the Triton and cascade attention, CUDA-graph replay and compiled decode step give
what the SDPA reference path and ``model.generate`` give, for models whose head_dim is 48, 64, 80, 96
or 128, with batches from 1 row to 256 rows that finish at different steps (flagged rows, compaction
into smaller graph buckets); sampled log-probs equal a teacher-forced pass."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_generate_reference

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.hf import sequence_logprobs
from rlvr.modeling import build_model, small_olmo2_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "How many",
    "Weng earns $12 an hour. How much",
    "Betty is saving money for a new wallet which costs $100.",
    "Janet",
    "x",
    "A robe takes 2 bolts",
    "James writes a 3-page letter to 2 different friends twice a week.",
]


def model_with_head_dim(tok, head_dim: int, dtype=torch.float32):
    """A random 2-layer OLMo-2 on the GPU with 4 heads of ``head_dim``."""
    heads = 4
    model = build_model(small_olmo2_config(tok, hidden_size=heads * head_dim, num_layers=2, num_heads=heads), seed=0)
    return model.to("cuda", dtype).eval()


def row_caps(prompts: int, n: int, most: int) -> list[list[int]]:
    """Per-row length caps spread over [1, most]: rows retire at many different steps (flags,
    compaction into smaller graph buckets) whatever the random model says."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, most + 1, (prompts, n), generator=g).tolist()


def ids(out):
    return [[c.token_ids for c in group] for group in out]


@pytest.mark.parametrize("head_dim", [48, 64, 80, 96, 128])
def test_greedy_triton_and_cascade_equal_sdpa_and_generate(tiny_tokenizer, head_dim):
    """Greedy, float32: 32 prompts x 8 samples = 256 rows (cascade buckets) retiring at many steps, and
    one prompt alone; the SDPA path itself equals ``model.generate``."""
    model = model_with_head_dim(tiny_tokenizer, head_dim)
    prompts = (PROMPTS * 4)[:32]
    params = SamplingParams(n=8, temperature=0.0, max_new_tokens=40)
    caps = row_caps(len(prompts), 8, 40)
    sdpa = FastHFEngine(model, tiny_tokenizer, attention="sdpa").generate(prompts, params, row_max_new_tokens=caps)
    refs = greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 40)
    plain = FastHFEngine(model, tiny_tokenizer, attention="sdpa").generate(PROMPTS, params)
    assert [g[0].token_ids for g in plain] == refs
    for group, ref, cap in zip(sdpa, refs * 4, caps):
        for c, most in zip(group, cap):
            assert c.token_ids == ref[:most]  # a capped greedy row is the uncapped one cut short
    for opts in (
        dict(attention="triton"),
        dict(attention="triton", cascade_min_rows=None),
        dict(attention="triton", cascade_min_rows=16, use_cuda_graphs=False),
    ):
        engine = FastHFEngine(model, tiny_tokenizer, **opts)
        out = engine.generate(prompts, params, row_max_new_tokens=caps)
        assert ids(out) == ids(sdpa), opts
        assert [c.finish_reason for g in out for c in g] == [c.finish_reason for g in sdpa for c in g]
        assert engine.stats["compactions"] > 0
        if opts.get("cascade_min_rows", 64) and opts.get("use_cuda_graphs", True):
            assert engine.stats["cascade_steps"] > 0
    one = FastHFEngine(model, tiny_tokenizer).generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=40))
    assert [one[0][0].token_ids] == refs[:1]


@pytest.mark.parametrize("head_dim", [48, 128])
def test_sampled_logprobs_are_teacher_forced(tiny_tokenizer, head_dim):
    model = model_with_head_dim(tiny_tokenizer, head_dim)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=24, seed=3)
    out = FastHFEngine(model, tiny_tokenizer).generate(PROMPTS, params)
    worst = 0.0
    for prompt, group in zip(PROMPTS, out):
        p_ids = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for c in group:
            x = torch.tensor([p_ids + c.token_ids], device="cuda")
            ref = sequence_logprobs(model, x, torch.ones_like(x))[0, len(p_ids) - 1 :].cpu()
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert worst < 1e-3, worst


def test_graph_replay_equals_eager_step_in_bf16(tiny_tokenizer):
    """The same kernels captured in CUDA graphs or launched one by one: identical bf16 tokens."""
    model = model_with_head_dim(tiny_tokenizer, 64, dtype=torch.bfloat16)
    prompts = (PROMPTS * 8)[:64]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=48, seed=0)
    graphs = FastHFEngine(model, tiny_tokenizer, use_cuda_graphs=True)
    replay = graphs.generate(prompts, params)
    assert graphs.stats["graphs_captured"] > 0
    eager = FastHFEngine(model, tiny_tokenizer, use_cuda_graphs=False).generate(prompts, params)
    assert ids(replay) == ids(eager)
