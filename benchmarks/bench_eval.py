"""Throughput of `rlvr eval`'s hf engine against plain ``model.generate``, in one run.

Builds a model of OLMo-2-0425-1B's exact architecture and size (``rlvr.modeling.OLMO2_1B``: 16 layers,
hidden 2048, 16 heads, FFN 8192, vocab 100352, untied) with random weights in bf16, and a byte-level
BPE tokenizer trained here on GSM8K text (smaller than the model's vocab: the engine masks the unused
ids). Then:

1. runs the three protocol prompts over ``--limit`` GSM8K test questions with ``rlvr.commands.evaluate.evaluate``
   and the hf engine (temperature 1, top-p 1, ``--max-new-tokens``; with random weights nearly every
   response runs to the limit, so this measures decoding at full length);
2. on a fixed subset of ``--baseline-n`` r1_zero prompts, times the hf engine and plain
   ``model.generate(do_sample=True)`` with the same batch and token limit;

and prints a Markdown table last (tokens/s, wall time, ratio to ``model.generate``).

GPU (one H200, about 3-4 minutes at the defaults):

    python benchmarks/bench_eval.py --data-dir ../shared/data/gsm8k

CPU smoke test: ``python benchmarks/bench_eval.py --data-dir ../shared/data/gsm8k --tiny``.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

PROMPTS = ("r1_zero", "question_only", "r1_zero_three_shot")


@dataclass
class BenchConfig:
    """Tokens/s of the hf engine through `rlvr eval`'s library function vs plain model.generate."""

    data_dir: Path
    """GSM8K directory holding train.jsonl and test.jsonl."""
    limit: int | None = None
    """Test questions per prompt (default 1024; 8 with --tiny)."""
    max_new_tokens: int | None = None
    """Token limit per response (default 512; 16 with --tiny)."""
    batch_size: int = 512
    """Sequences decoded together by the hf engine (and model.generate on the subset)."""
    baseline_n: int = 64
    """r1_zero prompts in the fixed subset timed with both model.generate and the engine."""
    tokenizer_rows: int = 7473
    """GSM8K train rows used to train the tokenizer."""
    tokenizer_vocab: int = 16000
    """Tokenizer vocabulary size (the model keeps OLMo-2's 100352 rows)."""
    tiny: bool = False
    """A tiny OLMo-2 config on CPU (float32) to check that the script runs."""
    seed: int = 0
    """Sampling and initialisation seed."""
    json_out: Path | None = None
    """Also write the measurements to this JSON file."""


def build(cfg: BenchConfig):
    from transformers import AutoModelForCausalLM, Olmo2Config

    from rlvr.modeling import OLMO2_1B, small_olmo2_config, train_tokenizer
    from rlvr.task.data import load_examples
    from rlvr.task.prompts import PROMPTS as SPECS
    from rlvr.task.prompts import load_template

    train = load_examples(str(cfg.data_dir), split="train", limit=cfg.tokenizer_rows)
    texts = [load_template(p) for p in SPECS] + [e.question for e in train] + [e.solution or "" for e in train]
    tokenizer = train_tokenizer(texts, vocab_size=400 if cfg.tiny else cfg.tokenizer_vocab)
    if cfg.tiny:
        config = small_olmo2_config(tokenizer, hidden_size=64, num_layers=2, num_heads=4)
        config.vocab_size = len(tokenizer) + 37  # like OLMo: more embedding rows than tokens
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the full benchmark needs a CUDA GPU; use --tiny to check the script on CPU")
        config = Olmo2Config(
            **OLMO2_1B,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    assert model.config.vocab_size >= len(tokenizer)
    return model, tokenizer, device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_generate(model, tokenizer, prompts, max_new_tokens, batch_size, device, seed):
    """Plain ``model.generate`` (sampling, temperature 1) over left-padded batches: (tokens, seconds)."""
    eos = tokenizer.eos_token_id
    tokens, t0 = 0, time.perf_counter()
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(
            prompts[start : start + batch_size],
            add_special_tokens=False,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        ).to(device)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
        )
        new = out[:, enc["input_ids"].shape[1] :]
        # tokens up to and including the first EOS of each row
        is_eos = (new == eos).int()
        after = (is_eos.cumsum(-1) - is_eos) > 0
        tokens += int((~after).sum())
    sync(device)
    return tokens, time.perf_counter() - t0


def main(argv=None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv)
    limit = cfg.limit or (8 if cfg.tiny else 1024)
    max_new = cfg.max_new_tokens or (16 if cfg.tiny else 512)
    t_start = time.perf_counter()

    from rlvr.commands.evaluate import evaluate
    from rlvr.engines.base import SamplingParams
    from rlvr.engines.hf import HFEngine
    from rlvr.task.data import load_examples
    from rlvr.task.prompts import render

    model, tokenizer, device = build(cfg)
    examples = load_examples(str(cfg.data_dir), split="test", limit=limit)
    engine = HFEngine(model, tokenizer, max_batch_size=cfg.batch_size)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=max_new, seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: OLMo-2 architecture, {n_params / 1e9:.3f} B parameters, vocab {model.config.vocab_size}, "
        f"{next(model.parameters()).dtype}, {device}; tokenizer {len(tokenizer)} tokens; "
        f"built in {time.perf_counter() - t_start:.1f} s",
        flush=True,
    )

    # Warm up kernels and allocator for both paths so that neither pays first-call costs.
    warm = [render("r1_zero", e.question) for e in examples[:2]]
    engine.generate(warm, SamplingParams(max_new_tokens=4, seed=0))
    time_generate(model, tokenizer, warm, 4, cfg.batch_size, device, cfg.seed)

    rows = []
    for name in PROMPTS:
        sync(device)
        t0 = time.perf_counter()
        metrics, _ = evaluate(
            model, tokenizer, examples, name, engine, params, progress=True, chunk_size=cfg.batch_size
        )
        sync(device)
        wall = time.perf_counter() - t0
        rows.append(
            {
                "run": f"rlvr eval ({name})",
                "questions": metrics["n"],
                "tokens": metrics["tokens"],
                "wall_s": wall,
                "tokens_per_s": metrics["tokens"] / wall,
                "truncated_rate": metrics["truncated_rate"],
                "mean_len": metrics["mean_response_length"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    subset = [render("r1_zero", e.question) for e in examples[: cfg.baseline_n]]
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(subset, params)
    sync(device)
    wall = time.perf_counter() - t0
    tok = sum(len(g[0].token_ids) for g in outs)
    engine_subset = {
        "run": "hf engine, r1_zero subset",
        "questions": len(subset),
        "tokens": tok,
        "wall_s": wall,
        "tokens_per_s": tok / wall,
    }
    tok, wall = time_generate(model, tokenizer, subset, max_new, cfg.batch_size, device, cfg.seed)
    generate_subset = {
        "run": "model.generate, r1_zero subset",
        "questions": len(subset),
        "tokens": tok,
        "wall_s": wall,
        "tokens_per_s": tok / wall,
    }
    rows += [engine_subset, generate_subset]
    base = generate_subset["tokens_per_s"]

    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print()
    print(
        f"GSM8K test, {limit} questions per prompt, max_new_tokens={max_new}, temperature 1.0, top-p 1.0, "
        f"batch {cfg.batch_size}, {gpu}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"random weights{' (tiny config)' if cfg.tiny else ''}; total {time.perf_counter() - t_start:.0f} s"
    )
    print()
    print("| run | questions | new tokens | wall (s) | tokens/s | vs model.generate |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['run']} | {r['questions']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base:.2f}x |"
        )
    if cfg.json_out:
        cfg.json_out.write_text(
            json.dumps(
                {"max_new_tokens": max_new, "limit": limit, "batch_size": cfg.batch_size, "device": gpu, "rows": rows},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
