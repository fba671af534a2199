"""The proof that GRPO learns to use a tool: a calculator on ``arith``, on a CPU in a few minutes.

1. **Warm start.** A fresh small OLMo-2 (``rlvr.commands.sft``) on arith reference solutions of which a share
   (the task's ``tool`` knob) compute with one calculator call, in the plain tool-call format, and the
   rest by hand, half of those with a slip (``noise``): the model learns both ways of answering, and
   that by hand it is often wrong.
2. **GRPO** with ``env.name tool`` (the calculator): the model's turns stop at ``</tool_call>``, the
   environment appends the result, the model goes on; the loss is on the model's tokens only. The
   reward is r1_zero's, on the answer.
3. **Before and after**, from the trainer's own validation through the same environment: accuracy
   (``val/reward``) and calculator calls per answer (``val/tool_calls``).

``tests/test_learning_tools.py`` runs it and asserts that both rise. ``python -m
rlvr.experiments.tool_proof --seeds 0 1 2 3`` runs it over several seeds (``--device cuda`` on a GPU).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rlvr.commands.sft import SFTConfig, run_sft
from rlvr.commands.train import train
from rlvr.config import (
    AlgorithmConfig,
    DataConfig,
    EngineConfig,
    EnvConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
)
from rlvr.training.metrics_log import read_metrics
from rlvr.training.rundir import atomic_write_json


@dataclass
class ToolProofConfig:
    """Warm-start a small model on arith with and without calculator calls, then GRPO with the calculator."""

    out: Path = Path("runs/tool_proof")
    """Run directory: sft/ (warm start), grpo/ (the GRPO run), tool_proof.json."""
    task: str = "arith:steps=1,max_value=10,noise=0.5,tool=0.3"
    """Task of both stages (its tool knob: the share of warm-start solutions that call the calculator)."""
    model_size: str = "small"
    """Size of the fresh model (rlvr.modeling.MODEL_SIZES)."""
    vocab_size: int = 640
    """Vocabulary of the locally trained tokenizer."""
    sft_steps: int = 400
    """Warm-start optimizer steps (batch 32)."""
    sft_lr: float = 3e-3
    """Warm-start peak learning rate."""
    grpo_steps: int = 30
    """GRPO rollout steps (one optimizer step each)."""
    grpo_lr: float = 2e-4
    """GRPO learning rate."""
    n_prompts: int = 8
    """Prompts per rollout batch."""
    group_size: int = 8
    """Samples per prompt."""
    max_new_tokens: int = 48
    """Cap of each model turn (a tool call is about 30 tokens)."""
    max_tokens: int = 96
    """Cap of a whole conversation after the prompt (env.max_tokens)."""
    val_size: int = 100
    """Held-out validation problems per evaluation."""
    eval_every: int = 0
    """Validate every this many GRPO steps (0: at the start and the end only)."""
    seed: int = 0
    """Seed of the model, the data order and the sampling."""
    device: str = "cpu"
    """Device of both stages."""
    progress: bool = False
    """Show progress bars."""
    reuse_sft: bool = False
    """Reuse a finished warm start found in OUT/sft (to try GRPO settings again)."""


def _warm_start(cfg: ToolProofConfig, sft_dir: Path) -> None:

    run_sft(
        SFTConfig(
            data=cfg.task,
            model=cfg.model_size,
            out=sft_dir,
            steps=cfg.sft_steps,
            batch_size=32,
            device=cfg.device,
            lr=cfg.sft_lr,
            warmup_steps=10,
            seed=cfg.seed,
            vocab_size=cfg.vocab_size,
            progress=cfg.progress,
            overwrite=True,
        )
    )


def run_tool_proof(cfg: ToolProofConfig) -> dict:
    """Run it; returns accuracy and calls per answer before and after, and writes ``OUT/tool_proof.json``."""

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sft_dir, grpo_dir = out / "sft", out / "grpo"
    t0 = time.perf_counter()
    reuse = cfg.reuse_sft and (sft_dir / "config.json").is_file() and (sft_dir / "sft_config.json").is_file()
    if not reuse:
        _warm_start(cfg, sft_dir)
    t_sft = time.perf_counter() - t0
    config = TrainConfig(
        model=ModelConfig(name_or_path=str(sft_dir)),
        data=DataConfig(
            train_source=cfg.task,
            train_split="train",
            train_size=None,
            val_source=cfg.task,
            val_split="validation",
            val_size=cfg.val_size,
        ),
        prompt="r1_zero",
        algorithm=AlgorithmConfig(preset="grpo"),
        rollout=RolloutConfig(
            n_prompts_per_rollout_batch=cfg.n_prompts, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens
        ),
        optim=OptimConfig(lr=cfg.grpo_lr, gradient_accumulation_steps=1),
        engine=EngineConfig(name="hf", device=cfg.device),
        env=EnvConfig(name="tool", tools=("calculator",), tool_format="plain", max_turns=2, max_tokens=cfg.max_tokens),
        log=LogConfig(progress=cfg.progress, val_samples=8),
        n_steps=cfg.grpo_steps,
        eval_every=cfg.eval_every,
        dump_every=5,
        save_every=0,
        seed=cfg.seed,
        policy_device=cfg.device,
    )
    t1 = time.perf_counter()
    if grpo_dir.exists():  # its own previous run: start again from the warm start
        shutil.rmtree(grpo_dir)
    train(config, grpo_dir)
    t_grpo = time.perf_counter() - t1
    val = [r for r in read_metrics(grpo_dir / "metrics.jsonl") if "val/reward" in r]
    before, after = val[0], val[-1]
    result = {
        "accuracy_before": before["val/reward"],
        "accuracy_after": after["val/reward"],
        "tool_calls_before": before.get("val/tool_calls", 0.0),
        "tool_calls_after": after.get("val/tool_calls", 0.0),
        "tool_errors_after": after.get("val/tool_errors", 0.0),
        "val_steps": [r["step"] for r in val],
        "seconds_sft": t_sft,
        "seconds_grpo": t_grpo,
        "task": cfg.task,
        "seed": cfg.seed,
        "device": cfg.device,
    }
    atomic_write_json(out / "tool_proof.json", result)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ToolProofConfig.out)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--reuse-sft", action="store_true")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    results = [
        run_tool_proof(
            ToolProofConfig(
                out=args.out / f"seed_{s}", device=args.device, seed=s, reuse_sft=args.reuse_sft, progress=args.progress
            )
        )
        for s in args.seeds
    ]
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
