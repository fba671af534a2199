"""The fast engine on every family it runs (OLMo-2, Llama with llama3 rope scaling, Qwen2 with q/k/v biases,
Qwen3 with per-head q/k norms; grouped-query attention, tied and untied embeddings, head_dims that are not
powers of two): greedy tokens equal ``model.generate``, sampled log-probs equal a teacher-forced pass, the
compiled step with stacked projections equals the eager one, each family trains through ``train``; other
architectures get a one-line message, and ``engine.name: auto`` falls back to ``hf`` for them."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_SHAPES, family_config, family_model, greedy_generate_reference
from test_engines_fast import PROMPTS, _fast, _ids, assert_logprobs_are_teacher_forced

from rlvr.engines import make_engine
from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine, layout_of, unsupported_reason
from rlvr.engines.hf import HFEngine

FAMILIES = list(FAMILY_SHAPES)


def test_the_tiny_models_cover_every_layout(tiny_tokenizer):
    """What the other tests rely on: each family's traits are really in its tiny model."""
    layouts = {f: layout_of(family_model(f, tiny_tokenizer)) for f in FAMILIES}
    assert {f: lay.groups for f, lay in layouts.items()} == {"olmo2": 2, "llama": 3, "qwen2": 4, "qwen3": 2}
    assert {f: lay.head_dim for f, lay in layouts.items()} == {"olmo2": 8, "llama": 16, "qwen2": 12, "qwen3": 48}
    assert {f: lay.family.qk_norm for f, lay in layouts.items()} == {
        "olmo2": "all_heads",
        "llama": None,
        "qwen2": None,
        "qwen3": "per_head",
    }
    llama, qwen2 = family_model("llama", tiny_tokenizer), family_model("qwen2", tiny_tokenizer)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight  # tied
    assert llama.config.rope_parameters["rope_type"] == "llama3"
    assert qwen2.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_model_generate_and_hf_engine(family, tiny_tokenizer):
    model = family_model(family, tiny_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    fast = _fast(model, tiny_tokenizer).generate(PROMPTS, params)
    assert [g[0].token_ids for g in fast] == greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 24)
    hf = HFEngine(model, tiny_tokenizer, max_batch_size=16).generate(PROMPTS, params)
    assert _ids(fast) == _ids(hf)
    for f, h in zip(fast, hf):
        assert f[0].text == h[0].text and f[0].finish_reason == h[0].finish_reason
        assert f[0].logprobs == pytest.approx(h[0].logprobs, abs=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logprobs_equal_teacher_forced(family, tiny_tokenizer):
    model = family_model(family, tiny_tokenizer)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7)
    out = _fast(model, tiny_tokenizer).generate(PROMPTS, params)
    assert_logprobs_are_teacher_forced(model, tiny_tokenizer, PROMPTS, out, atol=1e-4)
    assert len({tuple(c.token_ids) for c in out[0]}) > 1


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_head_dims_of_real_models(head_dim, tiny_tokenizer):
    """The head_dims real models use, on one-layer Llama models with grouped-query attention."""
    model = family_model(
        "llama",
        tiny_tokenizer,
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    fast = _fast(model, tiny_tokenizer, fused_norms=False).generate(PROMPTS[:2], params)
    assert [g[0].token_ids for g in fast] == greedy_generate_reference(model, tiny_tokenizer, PROMPTS[:2], 10)


def test_compiled_step_with_stacked_projections_equals_model_generate(tiny_tokenizer):
    """``compile_step=True`` with ``fuse_projections`` (stacked q/k/v weights and biases of unequal widths
    under grouped-query attention, stacked gate/up) decodes what ``model.generate`` does, for a Qwen2 model
    (biases) and a Qwen3 model (per-head q/k norms); the stacked copies follow in-place updates. (The
    compiled sampling is family-independent: test_engines_fast checks it.)"""
    pytest.importorskip("torch._inductor")
    import torch._dynamo

    torch._dynamo.reset()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    for family in ("qwen2", "qwen3"):
        model = family_model(family, tiny_tokenizer, num_layers=1)
        compiled = _fast(model, tiny_tokenizer, compile_step=True)
        out = [g[0].token_ids for g in compiled.generate(PROMPTS, greedy)]
        assert compiled._state.wqkv and compiled._state.wgate_up
        assert (compiled._state.bqkv[0][0] is not None) == (family == "qwen2")
        assert out == greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 8)
        with torch.no_grad():
            attn = model.model.layers[0].self_attn
            attn.k_proj.weight.mul_(-2.0)
            attn.v_proj.weight.mul_(3.0)
            if attn.v_proj.bias is not None:
                attn.v_proj.bias.add_(1.0)
        after = [g[0].token_ids for g in compiled.generate(PROMPTS, greedy)]
        assert after == greedy_generate_reference(model, tiny_tokenizer, PROMPTS, 8)
        assert after != out
    torch._dynamo.reset()


def test_unsupported_models_get_one_line_naming_the_families_and_the_fallback(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError) as err:
        FastHFEngine(gpt2, tiny_tokenizer)
    msg = str(err.value)
    assert "\n" not in msg and "engine.name: hf" in msg and "GPT2LMHeadModel" in msg
    for name in ("OLMo-2", "Llama", "Qwen2", "Qwen3"):
        assert name in msg
    # Families it runs, with settings it does not implement
    dynamic = family_config("llama", tiny_tokenizer, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "changes with length" in unsupported_reason(dynamic) and "engine.name: hf" in unsupported_reason(dynamic)
    sliding = family_config("qwen2", tiny_tokenizer, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "sliding-window" in unsupported_reason(sliding)
    assert all(unsupported_reason(family_config(f, tiny_tokenizer)) is None for f in FAMILIES)


def test_auto_engine_picks_hf_fast_when_it_can(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    assert isinstance(make_engine("auto", family_model("qwen3", tiny_tokenizer), tiny_tokenizer), FastHFEngine)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=4))
    assert isinstance(make_engine("auto", gpt2, tiny_tokenizer), HFEngine)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_with_hf_fast(family, gsm8k_path, tiny_tokenizer, tmp_path):
    """Two GRPO steps through ``train`` with ``engine.name: hf-fast`` (and ``auto``, which picks it): sane
    metrics, including the engine's log-probs against the trainer's at every step."""
    from test_trainer import check_sane, run, tiny_config

    from rlvr.config import EngineConfig
    from rlvr.engines import build_engine
    from rlvr.training.metrics_log import read_metrics

    model = family_model(family, tiny_tokenizer)
    name = "auto" if family == "qwen3" else "hf-fast"
    cfg = tiny_config(gsm8k_path, engine=EngineConfig(name=name, max_batch_size=8))
    assert isinstance(build_engine(cfg.engine, model, tiny_tokenizer), FastHFEngine)  # as the trainer builds it
    before = [p.detach().clone() for p in model.parameters()]
    run(cfg, tmp_path, model, tiny_tokenizer)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    check_sane(rows)
    assert all("train/engine_logprob_diff" in r for r in rows[1:] if r["train/engine_token_match_frac"] > 0)
    if any(r["train/zero_adv_frac"] < 1 for r in rows[1:]):
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_train_refuses_a_local_model_hf_fast_cannot_run_before_loading_it(gsm8k_path, tmp_path):
    from test_trainer import tiny_config
    from transformers import GPT2Config

    from rlvr.commands.train import train
    from rlvr.config import ConfigError, EngineConfig, ModelConfig

    GPT2Config(n_embd=32, n_layer=1, n_head=4).save_pretrained(tmp_path / "gpt2")  # a config, no weights
    cfg = tiny_config(
        gsm8k_path, engine=EngineConfig(name="hf-fast"), model=ModelConfig(name_or_path=str(tmp_path / "gpt2"))
    )
    with pytest.raises(ConfigError, match=r"hf-fast: hf-fast runs OLMo-2 .*, not gpt2; use engine.name: hf"):
        train(cfg, tmp_path / "run")
