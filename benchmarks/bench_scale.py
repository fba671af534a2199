"""Step time and peak GPU memory of ``rlvr train`` on one GPU with the memory levers: FSDP2 (a process
group of one: float32 sharded parameters and AdamW state, bf16 compute; or all bf16 with
``optim.master_weights: false``), its CPU offload, LoRA and
gradient checkpointing, at OLMo-2-1B's shape and at OLMo-2-7B's shape (random weights, a tokenizer
trained on GSM8K). Every case is ``rlvr.commands.train.train`` itself (hf-fast engine, parity reward so that
groups have signal), run in its own process so that a case that runs out of memory leaves the others;
the table is printed last.

    PYTHONPATH=src:benchmarks python benchmarks/bench_scale.py --data-dir ../shared/data/gsm8k

Each case: 3 steps of 16 prompts x 8 samples, at most 256 new tokens; the step time is the mean of
steps 2 and 3 (step 1 captures the engine's CUDA graphs). ``ckpt s`` is the final checkpoint (sharded
DCP + merged HF export + checksums) where it is written; the 7B cases skip it (its optimizer state
alone is 56 GB, larger than the benchmark machine's free disk).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rlvr.modeling import OLMO2_1B, OLMO2_7B

LORA = {"rank": 16, "alpha": 32, "target_modules": ["all-linear"]}
CASES = {
    # name: (shape, strategy, cpu_offload, lora, gradient checkpointing, rows per microbatch, write checkpoint,
    #        float32 master weights)
    "1b": ("1b", "none", False, None, False, 16, False, True),
    "1b-fsdp": ("1b", "fsdp", False, None, False, 16, True, True),
    "1b-fsdp-offload": ("1b", "fsdp", True, None, False, 32, False, True),
    "1b-lora": ("1b", "none", False, LORA, False, 16, True, True),
    "7b-lora": ("7b", "none", False, LORA, True, 16, False, True),
    "7b-fsdp-bf16": ("7b", "fsdp", False, None, True, 16, False, False),
    "7b-fsdp-offload": ("7b", "fsdp", True, None, True, 32, False, True),
    "1b-fsdp-offload-ckpt": ("1b", "fsdp", True, None, True, 32, False, True),
    "7b-fsdp": ("7b", "fsdp", False, None, False, 4, False, True),
    "7b-fsdp-offload-no-ckpt": ("7b", "fsdp", True, None, False, 8, False, True),
}


# The 1B shape cut down to a CPU-sized model (--tiny), as bench_speed.py does.
TINY = dict(
    OLMO2_1B, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
)


def run_case(name: str, data_dir: str, out: Path, tiny: bool = False) -> dict:
    import torch
    from transformers import Olmo2Config

    import rlvr.commands.train as trainer
    from rlvr.config import (
        DataConfig,
        DistributedConfig,
        EngineConfig,
        FastEngineConfig,
        LogConfig,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TrainConfig,
    )
    from rlvr.modeling import build_model, tokenizer_corpus, train_tokenizer
    from rlvr.task.data import load_gsm8k_jsonl
    from rlvr.training.metrics_log import read_metrics

    shape_name, strategy, offload, lora, ckpting, micro, write_ckpt, master = CASES[name]
    examples = load_gsm8k_jsonl(Path(data_dir) / "train.jsonl")
    tok = train_tokenizer(tokenizer_corpus(examples), vocab_size=8192)
    shape = dict(TINY if tiny else OLMO2_1B if shape_name == "1b" else OLMO2_7B)
    device = "cpu" if tiny else "cuda"
    config = Olmo2Config(
        **shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    dtype = torch.float32 if (strategy == "fsdp" and master) or tiny else torch.bfloat16
    with torch.device(device):
        model = build_model(config, seed=0, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    n_prompts, group = 16, 8
    cfg = TrainConfig(
        model=ModelConfig(
            name_or_path="random-weights",
            dtype="float32" if tiny else "bfloat16",
            gradient_checkpointing=ckpting,
            lora=LoraConfig(**{**lora, "target_modules": tuple(lora["target_modules"])}) if lora else LoraConfig(),
        ),
        data=DataConfig(train_source=str(Path(data_dir) / "train.jsonl"), train_size=512, val_size=0),
        prompt="r1_zero",
        rollout=RolloutConfig(n_prompts_per_rollout_batch=n_prompts, group_size=group, max_new_tokens=256),
        optim=OptimConfig(lr=1e-6, gradient_accumulation_steps=n_prompts * group // micro, master_weights=master),
        engine=EngineConfig(
            name="hf" if tiny else "hf-fast", fast=FastEngineConfig(release_memory=shape_name == "7b" and not tiny)
        ),
        log=LogConfig(progress=False, engine_logprob_check_every=0, val_samples=0),
        distributed=DistributedConfig(strategy=strategy, cpu_offload=offload),
        n_steps=3,
        policy_device=device,
        eval_every=0,
        eval_at_start=False,
        dump_every=0,
        save_every=0,
        save_at_end=write_ckpt,
    )
    ckpt_time = {"s": None}
    original = trainer.RunRecord.checkpoint

    def checkpoint(self):  # the final checkpoint, timed
        t0 = time.perf_counter()
        original(self)
        ckpt_time["s"] = time.perf_counter() - t0

    trainer.RunRecord.checkpoint = checkpoint

    def parity(response: str, ground_truth: str) -> dict:
        r = float(len(response) % 2 == 0)
        return {"reward": r, "answer_reward": r, "format_reward": r}

    if not tiny:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train(cfg, out, model=model, tokenizer=tok, reward_fn=parity)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 1]
    warm = rows[1:] or rows
    mean = lambda key: sum(r.get(key, 0.0) for r in warm) / len(warm)  # noqa: E731
    return {
        "case": name,
        "params_b": n_params / 1e9,
        "strategy": strategy,
        "offload": offload,
        "lora": bool(lora),
        "grad_ckpt": ckpting,
        "master": master,
        "step_s": mean("time/step"),
        "generate_s": mean("time/generate"),
        "train_s": mean("time/train"),
        "engine_copy_s": mean("time/engine_copy"),
        "peak_gib": max(r.get("mem/peak_gb", 0.0) for r in rows),
        "ckpt_s": ckpt_time["s"],
        "run_s": time.perf_counter() - t0,
        "tokens_per_step": mean("train/response_length") * n_prompts * group,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data/gsm8k")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="runs/bench_scale")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="skip the cases that would start after this")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks that every case runs")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    out = Path(args.out)
    if args.case:
        result = run_case(args.case, args.data_dir, out / args.case, args.tiny)
        (out / f"{args.case}.json").write_text(json.dumps(result))
        return
    out.mkdir(parents=True, exist_ok=True)
    t_start, results = time.perf_counter(), []
    for name in args.cases:
        left = args.deadline_s - (time.perf_counter() - t_start)
        if left < 30:
            print(f"{name}: skipped (deadline)")
            continue
        cmd = [sys.executable, __file__, "--case", name, "--data-dir", args.data_dir, "--out", str(out)]
        cmd += ["--tiny"] if args.tiny else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            ok = proc.returncode == 0
            tail = [line for line in (proc.stderr or "").strip().splitlines() if "Error" in line][-3:]
        except subprocess.TimeoutExpired:
            ok, tail = False, ["timed out"]
        if ok:
            results.append(json.loads((out / f"{name}.json").read_text()))
            print(f"{name}: done in {results[-1]['run_s']:.0f} s", flush=True)
        else:
            print(f"{name}: FAILED: {' | '.join(tail)}", flush=True)
    print(
        "\n| case | params | strategy | float32 weights | CPU offload | LoRA | grad ckpt | step s | generate s | train s | engine copy s | peak GiB | ckpt s |"
    )
    print("|---|---:|---|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ckpt = f"{r['ckpt_s']:.1f}" if r["ckpt_s"] is not None else "-"
        print(
            f"| {r['case']} | {r['params_b']:.2f} B | {r['strategy']} | {'yes' if r['master'] else 'no'} | "
            f"{'yes' if r['offload'] else 'no'} | "
            f"{'r16' if r['lora'] else 'no'} | {'yes' if r['grad_ckpt'] else 'no'} | {r['step_s']:.2f} | "
            f"{r['generate_s']:.2f} | {r['train_s']:.2f} | {r['engine_copy_s']:.2f} | {r['peak_gib']:.1f} | {ckpt} |"
        )


if __name__ == "__main__":
    main()
