"""Shared fixtures: a tiny real transformers model (Olmo2ForCausalLM, random weights) and a byte-level
BPE tokenizer trained locally on GSM8K text and the prompt templates. ``gsm8k_path`` is the project's
own GSM8K-format rows (tests/fixtures/gsm8k, written for rlvr), there in every clone; ``gsm8k_real_path``
is the real GSM8K read from ../shared, for the tests about that data (skipped without it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# The tests sit in folders that mirror src/rlvr, and some reuse another folder's helpers (the trainer
# tests' tiny config, the engine tests' cases): every folder is importable, whichever file runs alone.
sys.path[1:1] = [str(folder) for folder in sorted(TESTS.iterdir()) if folder.is_dir() and any(folder.glob("test_*.py"))]
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"
GSM8K_FORMAT_ROWS = Path(__file__).resolve().parent / "fixtures" / "gsm8k"


def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip("GSM8K copy not found at ../shared/data/gsm8k relative to the repo")
    return GSM8K_DIR


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    """A folder of GSM8K-format rows (train.jsonl: 200, test.jsonl: 100) for tests that need the format only."""
    return GSM8K_FORMAT_ROWS


@pytest.fixture(scope="session")
def gsm8k_real_path() -> Path:
    return gsm8k_dir()


def _tokenizer_corpus(n_rows: int = 300) -> list[str]:
    from rlvr.task.prompts import PROMPTS, load_template

    texts = [load_template(name) for name in PROMPTS]
    path = GSM8K_DIR / "train.jsonl"
    if path.is_file():
        with path.open() as f:
            for i, line in enumerate(f):
                if i >= n_rows:
                    break
                row = json.loads(line)
                texts += [row["question"], row["answer"]]
    texts += ["</think> <answer> 42 </answer>", "\\boxed{18}"] * 5
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from rlvr.modeling import train_tokenizer

    return train_tokenizer(_tokenizer_corpus(), vocab_size=400)


# A chat template in the style of OLMo-2/Tulu, with its role markers as single special tokens so that a
# conversation's tokens can be written out by hand: the assistant's turn ends with EOS (where
# generation stops), every other turn with <|end|>.
CHAT_ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TOKEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|endoftext|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer(tokenizer):
    """A copy of ``tokenizer`` with the role tokens and ``TOKEN_CHAT_TEMPLATE`` (the original is untouched)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": CHAT_ROLE_TOKENS})
    tok.chat_template = TOKEN_CHAT_TEMPLATE
    return tok


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    config = small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    model = build_model(config, seed=0)
    model.eval()  # no dropout in Olmo2, but be explicit: tests compare exact values
    return model


# One tiny model per family the fast engine runs, each with the traits of its real models and, between
# them, every layout path: grouped-query attention (2, 3 and 4 query heads per key/value head), q/k/v
# biases (Qwen2), per-head q/k norms (Qwen3), q/k norms over all heads (OLMo-2), tied and untied
# embeddings, llama3 rope scaling, head_dims that are and are not powers of two and one set apart from
# hidden_size / heads.
FAMILY_SHAPES = {
    "olmo2": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama": dict(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=48, tie_word_embeddings=False),
}


def family_config(family: str, tokenizer, num_layers: int = 2, **overrides):
    """The config of a tiny ``family`` model (see ``FAMILY_SHAPES``) for ``tokenizer``."""
    from transformers import AutoConfig

    shape = dict(FAMILY_SHAPES[family], **overrides)
    shape.setdefault("intermediate_size", 2 * shape["hidden_size"])
    return AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        num_hidden_layers=num_layers,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **shape,
    )


def family_model(family: str, tokenizer, seed: int = 0, **overrides):
    """A tiny random ``family`` causal LM (float32, eval mode)."""
    from rlvr.modeling import build_model

    model = build_model(family_config(family, tokenizer, **overrides), seed=seed)
    if family == "qwen2":  # transformers initialises biases to 0; make them count
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(0.5 * torch.randn(proj.bias.shape, generator=g))
    return model.eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def greedy_generate_reference(model, tok, prompts, max_new_tokens):
    """Greedy ``model.generate`` on a left-padded batch: new tokens per prompt, cut after EOS (the
    reference that the engines' greedy decoding must equal)."""
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    L = max(map(len, enc))
    ids = torch.full((len(enc), L), tok.pad_token_id)
    mask = torch.zeros((len(enc), L), dtype=torch.long)
    for r, e in enumerate(enc):
        ids[r, L - len(e) :] = torch.tensor(e)
        mask[r, L - len(e) :] = 1
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    refs = []
    for row in out[:, L:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        refs.append(row)
    return refs


# tests/interpreted runs the Triton kernels on the CPU through Triton's interpreter, which must be on
# before the kernels are defined: test_decode_attention.py runs that folder in a child pytest with
# TRITON_INTERPRET=1 set; a plain run leaves it out.
collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted/*"]


def padded_and_packed(model, tok, weights, chunk_tokens):
    """Log-probs of a tokenised batch at its response positions, padded and then packed
    (``rlvr.training.packing``), each with the parameters' gradients of ``sum(weights * log_probs)``."""
    from rlvr.training.logprobs import get_response_log_probs
    from rlvr.training.packing import packed_response_log_probs

    mask = tok["response_mask"].bool()
    rows = list(range(mask.shape[0]))
    results = []
    for packed in (False, True):
        if packed:
            out = packed_response_log_probs(
                model, tok["input_ids"], tok["labels"], mask, rows, mask.shape[1], chunk_tokens, True
            )
        else:
            out = get_response_log_probs(model, tok["input_ids"], tok["labels"], True, positions=mask)
        out["log_probs"].mul(weights).sum().backward()
        results.append((out, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return results
