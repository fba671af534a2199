"""Speed and memory of the assistant half at Llama-3.1-8B's shape (random weights, bf16, one GPU).

Sections (``--sections``, default both):

- ``eval``: ``rlvr eval --suite mmlu gsm8k``'s runner (``rlvr.suites.run.run_suite``) over the first
  ``--limit`` questions of each suite, greedy, in base-model mode (zero-shot system prompt, stop at
  ``# Query:``) through the ``--engine`` engine (``auto``: ``hf-fast`` on a GPU). With random weights no output stops by itself, so
  every output runs to ``--max-tokens``: this measures decoding at that length. Reported: examples/s,
  new tokens/s, mean prompt tokens.
- ``dpo``: ``rlvr.commands.dpo.dpo_step``, the function ``rlvr dpo`` runs per optimizer step, on ``--pairs``
  synthetic pairs of ``--pair-tokens`` tokens (chosen) and 7/8 of that (rejected), policy and frozen
  reference both on ``--device`` (or the reference on ``--ref-device``): the first step (reference
  log-probs computed, as in the first epoch) and a warm step (reference cached), seconds per step and
  per pair, and peak memory; for RMSprop with float32 master weights (the default of ``rlvr dpo`` on a
  bf16 model) and without them.

The model is ``LlamaForCausalLM`` with ``rlvr.modeling.LLAMA31_8B`` (32 layers, hidden 4096, 8 KV
heads, vocab 128,256); the tokenizer is a byte-level BPE trained here on MMLU and GSM8K text with a
Llama-3-style BOS (the engine masks the ids it cannot decode). A Markdown table is printed last.

GPU (one H200):   ``PYTHONPATH=src python benchmarks/bench_assistant.py --data-dir ../shared/data``
CPU smoke test:   ``PYTHONPATH=src python benchmarks/bench_assistant.py --data-dir ../shared/data --tiny``
"""

from __future__ import annotations

import gc
import json
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro


@dataclass
class BenchConfig:
    """Assistant-suite throughput and one DPO step at Llama-3.1-8B's shape (random weights)."""

    data_dir: Path
    """Folder with mmlu/ and gsm8k/ (the course's layout)."""
    sections: tuple[str, ...] = ("eval", "dpo")
    """Which sections to run: eval, dpo."""
    limit: int | None = None
    """Questions per suite (default 512; 4 with --tiny)."""
    max_tokens: int | None = None
    """New tokens per output (default 256; 8 with --tiny)."""
    engine: str = "auto"
    """Engine for the eval section (auto: hf-fast, which runs Llama models, on a GPU; hf on the CPU)."""
    batch_size: int = 256
    """Sequences decoded together."""
    pairs: int | None = None
    """Pairs per DPO optimizer step (default 64, the course's batch; 2 with --tiny)."""
    pair_tokens: int | None = None
    """Tokens of each chosen sequence; rejected ones have 7/8 as many (default 512; 24 with --tiny)."""
    device: str = "cuda"
    """Device of the model (and of the DPO policy)."""
    ref_device: str | None = None
    """Device of the DPO reference (default: --device)."""
    tiny: bool = False
    """A tiny Llama config on the CPU, float32: checks that the script runs."""
    json_out: Path | None = None
    """Also write the measurements to this JSON file."""


def build(cfg: BenchConfig, device: torch.device, dtype: torch.dtype):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from rlvr.modeling import LLAMA31_8B
    from rlvr.suites.data import load_gsm8k, load_mmlu

    texts = [r["question"] + " " + " ".join(r["options"]) for r in load_mmlu(cfg.data_dir / "mmlu", limit=3000)]
    texts += [r["question"] for r in load_gsm8k(cfg.data_dir / "gsm8k", "train", limit=3000)]
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400 if cfg.tiny else 16000,
            special_tokens=[bos, eos],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    shape = dict(LLAMA31_8B)
    if cfg.tiny:
        shape.update(
            hidden_size=64,
            intermediate_size=224,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=len(tokenizer) + 37,
        )
    config = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tokenizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def eval_section(cfg: BenchConfig, model, tokenizer, device, limit: int, max_tokens: int) -> list[dict]:
    from rlvr.engines import make_engine, resolve_engine_name
    from rlvr.suites.run import SUITES, load_suite_data, run_suite, wrap_prompt
    from rlvr.task.instruction_data import special_prefix

    name = "hf" if (cfg.engine == "auto" and device.type != "cuda") else resolve_engine_name(cfg.engine, model)
    engine = make_engine(name, model, tokenizer, max_batch_size=cfg.batch_size)
    prefix = special_prefix(tokenizer)
    rows = []
    warm = load_suite_data("gsm8k", str(cfg.data_dir / "gsm8k"), 2)
    run_suite(SUITES["gsm8k"], warm, engine, "base", 4, prefix)  # kernels and allocator warm
    for suite in ("mmlu", "gsm8k"):
        examples = load_suite_data(suite, str(cfg.data_dir / suite), limit)
        prompt_tokens = [
            len(
                tokenizer(wrap_prompt(SUITES[suite].instruction(ex), "base", prefix), add_special_tokens=False)[
                    "input_ids"
                ]
            )
            for ex in examples
        ]
        sync(device)
        metrics, _ = run_suite(SUITES[suite], examples, engine, "base", max_tokens, prefix, chunk_size=cfg.batch_size)
        sync(device)
        rows.append(
            {
                "section": "eval",
                "run": f"{suite} (base mode, {name})",
                "n": metrics["n"],
                "examples_per_s": metrics["examples_per_s"],
                "tokens_per_s": metrics["tokens_per_s"],
                "time_s": metrics["time_s"],
                "mean_output_tokens": metrics["mean_output_tokens"],
                "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
                "peak_gib": peak_gib(device),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    engine.close()
    return rows


def dpo_section(cfg: BenchConfig, model, tokenizer, device, pairs: int, pair_tokens: int) -> list[dict]:
    import copy

    from rlvr.commands.dpo import ReferenceCache, dpo_step
    from rlvr.training.optim import make_rmsprop

    ref_device = torch.device(cfg.ref_device) if cfg.ref_device else device
    reference = copy.deepcopy(model).to(ref_device).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    token_pairs = [
        (
            torch.randint(2, vocab, (pair_tokens,), generator=g).tolist(),
            torch.randint(2, vocab, (pair_tokens * 7 // 8,), generator=g).tolist(),
        )
        for _ in range(pairs)
    ]
    pad = tokenizer.pad_token_id
    rows = []
    policy = model
    policy.train().requires_grad_(True)
    # Without master weights first: with them, float32 masters, their gradients and RMSprop's state
    # dominate memory at 8B, and ``make_rmsprop`` steps tensor by tensor, as ``rlvr dpo`` does.
    for master in (False, True):
        optimizer = make_rmsprop(policy.parameters(), master_weights=master, lr=1e-6)
        cache = ReferenceCache(reference, pad, pairs)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(3):  # step 0: reference log-probs computed; later steps: cached
            sync(device)
            t0 = time.perf_counter()
            dpo_step(policy, optimizer, token_pairs, list(range(pairs)), cache, 0.1, pad, 1.0)
            sync(device)
            times.append(time.perf_counter() - t0)
        label = "RMSprop, fp32 master weights, per-tensor update" if master else "RMSprop on the model's weights"
        for name, t in (("first step (reference scored)", times[0]), ("warm step (reference cached)", min(times[1:]))):
            rows.append(
                {
                    "section": "dpo",
                    "run": f"{label}: {name}",
                    "n": pairs,
                    "time_s": t,
                    "s_per_pair": t / pairs,
                    "peak_gib": peak_gib(device),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv)
    device = torch.device("cpu" if cfg.tiny else cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the full benchmark needs a CUDA GPU; use --tiny to check the script on the CPU")
    dtype = torch.float32 if cfg.tiny else torch.bfloat16
    limit, max_tokens = cfg.limit or (4 if cfg.tiny else 512), cfg.max_tokens or (8 if cfg.tiny else 256)
    pairs, pair_tokens = cfg.pairs or (2 if cfg.tiny else 64), cfg.pair_tokens or (24 if cfg.tiny else 512)
    t_start = time.perf_counter()
    model, tokenizer = build(cfg, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Llama architecture, {n_params / 1e9:.3f} B parameters, {dtype}, {device}; tokenizer "
        f"{len(tokenizer)} tokens; built in {time.perf_counter() - t_start:.1f} s",
        flush=True,
    )
    rows: list[dict] = []
    for section in cfg.sections:
        try:
            if section == "eval":
                rows += eval_section(cfg, model, tokenizer, device, limit, max_tokens)
            elif section == "dpo":
                rows += dpo_section(cfg, model, tokenizer, device, pairs, pair_tokens)
            else:
                print(f"unknown section {section!r} (eval, dpo)")
        except Exception:  # noqa: BLE001 - one failing section must not hide the others' numbers
            traceback.print_exc()
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"\n{where}, torch {torch.__version__}, transformers {transformers.__version__}, random weights"
        f"{' (tiny config)' if cfg.tiny else ''}; eval: {limit} questions per suite, {max_tokens} new tokens, "
        f"batch {cfg.batch_size}; DPO: {pairs} pairs of {pair_tokens}/{pair_tokens * 7 // 8} tokens; "
        f"total {time.perf_counter() - t_start:.0f} s\n"
    )
    print("| section | run | n | time (s) | examples/s or s/pair | tokens/s | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = f"{r['examples_per_s']:.2f} ex/s" if "examples_per_s" in r else f"{r['s_per_pair']:.3f} s/pair"
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-"
        mem = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        print(f"| {r['section']} | {r['run']} | {r['n']} | {r['time_s']:.2f} | {rate} | {tps} | {mem} |")
    if cfg.json_out:
        cfg.json_out.write_text(json.dumps({"rows": rows, "device": where}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
