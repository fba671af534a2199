"""Shared fixtures: a tiny real transformers model (Olmo2ForCausalLM, random weights) and a byte-level
BPE tokenizer trained locally on GSM8K text and the prompt templates; GSM8K read from ../shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"


def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K copy not found at ../shared/data/gsm8k relative to the repo")
    return GSM8K_DIR


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    return gsm8k_dir()


def _tokenizer_corpus(n_rows: int = 300) -> list[str]:
    from rlvr.prompts import PROMPTS, load_template

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


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    config = small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    model = build_model(config, seed=0)
    model.eval()  # no dropout in Olmo2, but be explicit: tests compare exact values
    return model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
