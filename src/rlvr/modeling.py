"""Models and tokenizers: load from a local directory or the hub, or build small ones locally.

Tests and the CPU demo cannot download weights, so they build real transformers architectures
(``Olmo2ForCausalLM``) from a config with random weights, and train a small byte-level BPE
tokenizer with ``tokenizers`` on task text.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

from rlvr.errors import UserError
from rlvr.task.chat import ChatTemplateError, check_chat_template
from rlvr.task.prompts import render
from rlvr.training.checkpoint import file_problems
from rlvr.training.lora import apply_lora

if TYPE_CHECKING:
    from transformers import (
        Olmo2Config,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

    from rlvr.config import LoraConfig
    from rlvr.task.data import Example

SPECIAL_TOKENS = {"pad_token": "<|pad|>", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}

# OLMo-2-0425-1B's shape (allenai/OLMo-2-0425-1B config.json), for speed measurements with random weights.
OLMO2_1B = dict(
    vocab_size=100352,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# OLMo-2-1124-7B's shape (allenai/OLMo-2-1124-7B config.json), for the memory benchmarks with random weights.
OLMO2_7B = dict(
    OLMO2_1B,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
)
# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json), for the assistant benchmarks with random weights.
LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    rope_scaling={
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    tie_word_embeddings=False,
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, wrapped as a ``PreTrainedTokenizerFast``.

    Byte-level means any string round-trips (no unknown tokens), so prompts and model outputs
    outside the training text still tokenize.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted(set(SPECIAL_TOKENS.values()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


# Named sizes for fresh models (OLMo-2 architecture; the vocabulary comes from the tokenizer).
# Parameter counts below are for a 512-token vocabulary.
MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4),  # 0.2 M: unit tests
    "small": dict(hidden_size=128, num_layers=4, num_heads=4),  # 1.2 M: the CPU learning demo
    "20m": dict(hidden_size=384, num_layers=8, num_heads=8),  # 19.3 M: the GPU proof
    "olmo2-1b": dict(
        hidden_size=OLMO2_1B["hidden_size"],
        num_layers=OLMO2_1B["num_hidden_layers"],
        num_heads=OLMO2_1B["num_attention_heads"],
        intermediate_size=OLMO2_1B["intermediate_size"],
    ),
}


def small_olmo2_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
) -> Olmo2Config:
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )


def build_model(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A randomly initialised causal LM for ``config`` (deterministic for a given seed)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def fresh_model(
    size: str,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 2048,
) -> PreTrainedModel:
    """A randomly initialised OLMo-2 model of named ``size`` (see ``MODEL_SIZES``) for ``tokenizer``."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    config = small_olmo2_config(tokenizer, max_position_embeddings=max_position_embeddings, **MODEL_SIZES[size])
    if size == "olmo2-1b":
        config.rope_theta = OLMO2_1B["rope_theta"]
        config.rms_norm_eps = OLMO2_1B["rms_norm_eps"]
    return build_model(config, seed=seed, dtype=dtype)


def tokenizer_corpus(examples: Iterable[Example], prompt_name: str | None = "r1_zero") -> list[str]:
    """Texts to train a tokenizer on: each example's rendered prompt and its solution.

    The prompt template repeats in every text, so BPE learns it as a few long tokens and prompts
    stay short.
    """

    texts = []
    for ex in examples:
        texts.append(render(prompt_name, ex.question) if prompt_name else ex.question)
        if ex.solution:
            texts.append(ex.solution)
        texts.append(f" </think> <answer> {ex.ground_truth} </answer>")
    return texts


def save_model_and_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Write ``model`` and ``tokenizer`` to ``out_dir`` so that ``load_model_and_tokenizer`` reads them back."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def check_model_source(name_or_path: str | Path, flag: str = "--model") -> None:
    """Raise ``UserError`` (before anything loads) for a model that is neither a local model directory
    nor shaped like a hub id (``owner/name``); a hub id itself is checked when it loads."""

    name = str(name_or_path)
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(
                f"{flag} {name} is a directory without config.json, not a saved model; give the directory "
                "written by save_pretrained (e.g. a checkpoint's model/ folder, or rlvr sft's --out)"
            )
        return
    if p.exists():
        raise UserError(f"{flag} {name} is a file; give the model's directory (with config.json) or a hub id")
    if name.startswith(("/", ".", "~")) or not _HUB_ID.match(name) or ".." in name or "--" in name:
        raise UserError(
            f"{flag} {name}: no such directory; give a local model directory or a hub id such as allenai/OLMo-2-0425-1B"
        )


def load_model_and_tokenizer(
    name_or_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    flag: str = "--model",
    lora: LoraConfig | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or a hub id.

    The default dtype is bfloat16 on CUDA and float32 on CPU. A tokenizer without a pad token gets
    its EOS token as pad (right padding is masked everywhere, so the choice does not leak into losses).
    A missing local path, or a hub id that cannot be loaded, is a ``UserError`` naming ``flag``.
    ``lora`` (a ``rlvr.config.LoraConfig`` with a rank) adds peft LoRA adapters and freezes the rest.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_source(name_or_path, flag)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    local = Path(str(name_or_path)).expanduser().is_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if local:
            damaged = file_problems(Path(str(name_or_path)).expanduser())
            why = damaged[0] if damaged else f"{type(e).__name__}: {first}"
            raise UserError(
                f"{flag} {name_or_path} does not load: {why}; copy the model again or use another checkpoint"
            ) from None
        if not isinstance(e, OSError):
            raise
        raise UserError(
            f"{flag} {name_or_path}: no such local directory, and it could not be loaded from the hub "
            f"({first}); check the name, your network and HF_TOKEN, or give a local directory"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device)  # type: ignore[arg-type]  # transformers' stub of .to takes the model
    if lora is not None and lora.rank:
        # A peft model: it forwards attribute lookups to the PreTrainedModel it wraps.
        return apply_lora(model, lora), tokenizer  # type: ignore[return-value]
    return model, tokenizer


def attention_without_cudnn() -> contextlib.AbstractContextManager:
    """SDPA's backends less cuDNN's, on a GPU (elsewhere nothing changes); every ``rlvr`` command runs
    in it. cuDNN's attention builds an execution plan on the host for each new shape (host time at every
    layer call), and training microbatches, DPO pairs and the engines' prefill chunks change shape
    every batch; the flash and memory-efficient kernels have no such cost (the trainer profile in
    docs/benchmarks.md)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """A config's ``dtype`` on ``device``: ``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def check_chat_template_before_load(
    model: str,
    what: str = "conversational rows (messages, prompt/completion lists)",
    fix: str = "pass --chat-template FILE",
) -> None:
    """``ChatTemplateError`` (one line) when conversational rows meet a model whose tokenizer has no chat
    template: read from the tokenizer alone, before the model loads."""

    if model in MODEL_SIZES:
        raise ChatTemplateError(
            f"{what}: a fresh model of size {model} has a new tokenizer without a chat template; {fix}"
        )
    from transformers import AutoTokenizer

    check_chat_template(AutoTokenizer.from_pretrained(model), what, fix)


def read_chat_template(path: Path | None) -> str | None:
    """The text of a ``--chat-template`` file (None when not given)."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {path}: cannot be read ({e}); pass a UTF-8 Jinja template file") from None
