"""hf-fast on a GPU for every family it runs (OLMo-2, Llama with llama3 rope scaling, Qwen2 with q/k/v biases,
Qwen3 with per-head q/k norms; grouped-query attention with 2, 3 and 4 query heads per key/value head, tied
embeddings, head_dims 8 to 48): in its default configuration (Triton and cascade attention, CUDA graphs,
the compiled step with stacked projections) it gives what the SDPA path and ``model.generate`` give, its
sampled log-probs equal a teacher-forced pass, and graph replay equals the eager step in bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_SHAPES, family_model, greedy_generate_reference
from test_gpu_engine import PROMPTS, ids, row_caps

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.hf import sequence_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_default_engine_equals_sdpa_path_and_generate(tiny_tokenizer, family):
    """Greedy, float32: 32 prompts x 8 samples = 256 rows (cascade buckets) retiring at many steps."""
    model = family_model(family, tiny_tokenizer).to("cuda")
    prompts = (PROMPTS * 4)[:32]
    params = SamplingParams(n=8, temperature=0.0, max_new_tokens=32)
    caps = row_caps(len(prompts), 8, 32)
    refs = greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 32)
    sdpa = FastHFEngine(model, tiny_tokenizer, attention="sdpa").generate(prompts, params, row_max_new_tokens=caps)
    for group, ref, cap in zip(sdpa, refs * 4, caps):
        for c, most in zip(group, cap):
            assert c.token_ids == ref[:most]
    engine = FastHFEngine(model, tiny_tokenizer)
    out = engine.generate(prompts, params, row_max_new_tokens=caps)
    assert engine._attention_kind() == "triton" and engine._step_compiled() and engine._state.wqkv
    assert engine.stats["cascade_steps"] > 0 and engine.stats["compactions"] > 0
    assert ids(out) == ids(sdpa)


@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_sampled_logprobs_are_teacher_forced(tiny_tokenizer, family):
    model = family_model(family, tiny_tokenizer).to("cuda")
    out = FastHFEngine(model, tiny_tokenizer).generate(
        PROMPTS, SamplingParams(n=8, temperature=1.0, max_new_tokens=24, seed=3)
    )
    worst = 0.0
    for prompt, group in zip(PROMPTS, out):
        p_ids = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for c in group:
            x = torch.tensor([p_ids + c.token_ids], device="cuda")
            ref = sequence_logprobs(model, x, torch.ones_like(x))[0, len(p_ids) - 1 :].cpu()
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert worst < 1e-3, worst


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_graph_replay_equals_eager_step_in_bf16(tiny_tokenizer, family):
    model = family_model(family, tiny_tokenizer).to("cuda", torch.bfloat16)
    prompts = (PROMPTS * 8)[:64]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=0)
    graphs = FastHFEngine(model, tiny_tokenizer, use_cuda_graphs=True)
    replay = graphs.generate(prompts, params)
    assert graphs.stats["graphs_captured"] > 0
    eager = FastHFEngine(model, tiny_tokenizer, use_cuda_graphs=False, compile_step=graphs._step_compiled()).generate(
        prompts, params
    )
    assert ids(replay) == ids(eager)
