"""Seconds per GRPO step at OLMo-2-0425-1B's exact size: generate / train / sync, and peak memory.

Runs ``rlvr.trainer.train`` with SPEC's suggested configuration (32 prompts x 8 samples = 256
rollouts, gradient accumulation 32, AdamW, bf16 policy) on a randomly initialised model with
OLMo-2-0425-1B's architecture (``rlvr.modeling.OLMO2_1B``: 16 layers, hidden 2048, FFN 8192, 16 heads,
vocab 100352, untied embeddings) and a byte-level BPE tokenizer trained here on the GSM8K train split,
with the r1_zero prompt. Random weights never write ``</answer>``, so every response runs to
``--max-new-tokens``: the step times are the worst case for that length.

    python benchmarks/bench_train_gpu.py --data-dir PATH/TO/gsm8k                 # one GPU, in-process engine
    python benchmarks/bench_train_gpu.py --data-dir PATH/TO/gsm8k --engine hf-worker  # engine on cuda:1
    python benchmarks/bench_train_gpu.py --data-dir PATH/TO/gsm8k --tiny          # CPU smoke test

The last thing printed is a Markdown table for docs/benchmarks.md. Step 1 includes CUDA warm-up and
is reported apart from the mean over the later steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import zlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_policy(args, train_examples, device: torch.device):
    from transformers import AutoModelForCausalLM, Olmo2Config

    from rlvr.modeling import OLMO2_1B, fresh_model, tokenizer_corpus, train_tokenizer

    tokenizer = train_tokenizer(tokenizer_corpus(train_examples, "r1_zero"), vocab_size=args.tokenizer_vocab)
    if args.tiny:
        return fresh_model("tiny", tokenizer, seed=0), tokenizer
    config = Olmo2Config(**OLMO2_1B, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: 1.5 B parameters are slow to initialise on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model, tokenizer


def coin_reward(response: str, ground_truth: str) -> dict:
    """A fair coin per response (a stable hash), standing in for the grader: with random weights every
    graded reward is 0, every advantage is 0, and the train step would skip every sequence."""
    r = float(zlib.crc32(response.encode("utf-8")) % 2)
    return {"reward": r, "answer_reward": r, "format_reward": 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="directory holding GSM8K train.jsonl")
    p.add_argument("--steps", type=int, default=20, help="rollout steps to time")
    p.add_argument("--max-new-tokens", type=int, default=512, help="response cap (random weights always hit it)")
    p.add_argument("--engine", default="hf", choices=["hf", "hf-fast", "hf-worker"], help="hf or hf-fast: one GPU, in-process; hf-worker: engine on cuda:1")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=32)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                   help="optim.max_tokens_per_microbatch (use with --grad-accum 1)")
    p.add_argument("--compile", action="store_true", help="model.compile: torch.compile of the backbone for training")
    p.add_argument("--tokenizer-vocab", type=int, default=4096, help="size of the locally trained tokenizer")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, tiny batch, 2 steps")
    p.add_argument("--reward", default="coin", choices=["coin", "grader"],
                   help="coin: a deterministic hash of the response decides 0/1, so groups carry signal and the "
                        "train step does real work (random weights never answer right); grader: the r1_zero grader")
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = p.parse_args(argv)

    from rlvr.config import AlgorithmConfig, DataConfig, EngineConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
    from rlvr.data import load_examples
    from rlvr.logging_utils import read_metrics
    from rlvr.trainer import train

    if args.tiny:
        args.steps, args.max_new_tokens, args.n_prompts, args.group_size, args.grad_accum = min(args.steps, 2), 8, 2, 4, 2
        args.tokenizer_vocab = 512
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("no CUDA device: run with --tiny for a CPU smoke test", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    engine_device = "cuda:1" if args.engine == "hf-worker" and cuda and torch.cuda.device_count() > 1 else str(device)

    config = TrainConfig(
        data=DataConfig(train_source=args.data_dir, train_size=6400, val_size=0),
        prompt="r1_zero",
        algorithm=AlgorithmConfig(preset="grpo"),
        rollout=RolloutConfig(n_prompts_per_rollout_batch=args.n_prompts, group_size=args.group_size,
                              max_new_tokens=args.max_new_tokens),
        optim=OptimConfig(gradient_accumulation_steps=args.grad_accum, max_tokens_per_microbatch=args.max_tokens_per_microbatch),
        engine=EngineConfig(name=args.engine, device=engine_device, max_batch_size=args.n_prompts * args.group_size),
        log=LogConfig(progress=True, engine_logprob_check_every=0, val_samples=0),
        n_steps=args.steps, eval_every=0, eval_at_start=False, dump_every=0, save_every=0,
        policy_device=str(device),
    )
    config = config.resolve()
    config.validate()
    train_examples = load_examples(args.data_dir, "train", limit=6400)
    t0 = time.perf_counter()
    model, tokenizer = build_policy(args, train_examples, device)
    if args.gradient_checkpointing or args.compile:
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, gradient_checkpointing=args.gradient_checkpointing, compile=args.compile))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.3f} B parameters, built in {time.perf_counter() - t0:.1f} s; "
          f"tokenizer vocab {len(tokenizer)}", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_train_"))
    t0 = time.perf_counter()
    train(config, out, model=model, tokenizer=tokenizer, reward_fn=coin_reward if args.reward == "coin" else None)
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r.get("step", 0) > 0]
    peak_gb = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    reserved_gb = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else float("nan")

    def col(key, rs):
        vals = [r.get(key, 0.0) or 0.0 for r in rs]
        return statistics.mean(vals) if vals else float("nan")

    later = rows[1:] or rows
    keys = [("generate", "time/generate"), ("sync", "time/sync"), ("reward", "time/reward"),
            ("old log-probs", "time/logprobs"), ("train", "time/train"), ("step total", "time/step")]
    gpu = torch.cuda.get_device_name(device) if cuda else "CPU (--tiny smoke test)"
    print(json.dumps({"steps": len(rows), "wall_s": wall, "peak_allocated_gb": peak_gb, "peak_reserved_gb": reserved_gb,
                      "mean_response_length": col("train/response_length", rows),
                      "tokens_per_s": col("tokens_per_s", later), "run_dir": str(out)}))
    print()
    print(f"GRPO step at OLMo-2-0425-1B size ({'tiny model' if args.tiny else f'{n_params / 1e9:.2f} B params'}, "
          f"random weights, {'bf16' if cuda else 'fp32'}), {gpu}, engine `{args.engine}` on {engine_device}; "
          f"rollout {args.n_prompts} x {args.group_size}, max {args.max_new_tokens} new tokens "
          f"(mean response {col('train/response_length', rows):.0f} tokens), grad accumulation {args.grad_accum}"
          f"{f', token budget {args.max_tokens_per_microbatch}' if args.max_tokens_per_microbatch else ''}"
          f"{', model.compile' if args.compile else ''}"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''}; {len(rows)} steps.")
    print()
    print("| phase | step 1 (s) | mean of steps 2+ (s) |")
    print("|---|---|---|")
    for name, key in keys:
        print(f"| {name} | {rows[0].get(key, 0.0):.2f} | {col(key, later):.2f} |")
    print(f"| generation throughput (tokens/s) | {rows[0].get('tokens_per_s', 0.0):.0f} | {col('tokens_per_s', later):.0f} |")
    print(f"| peak GPU memory allocated / reserved (GiB) | {peak_gb:.1f} / {reserved_gb:.1f} | |")
    print()
    print("per step (s): " + "; ".join(f"{r['step']}: generate {r.get('time/generate', 0):.2f}, train "
                                      f"{r.get('time/train', 0):.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
