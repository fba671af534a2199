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

``tests/commands/test_learning_tools.py`` runs it and asserts that both rise. ``python -m
rlvr.experiments.tool_proof --seeds 0 1 2 3`` runs it over several seeds (``--device cuda`` on a GPU).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rlvr.commands.demo import WarmStartRecipe
from rlvr.commands.train import train
from rlvr.config import EnvConfig
from rlvr.training.metrics_log import read_metrics
from rlvr.training.rundir import atomic_write_json


@dataclass
class ToolProofConfig(WarmStartRecipe):
    """Warm-start a small model on arith with and without calculator calls, then GRPO with the calculator."""

    out: Path = Path("runs/tool_proof")
    """Run directory: sft/ (warm start), grpo/ (the GRPO run), tool_proof.json."""
    task: str = "arith:steps=1,max_value=10,noise=0.5,tool=0.3"
    """Task of both stages (its tool knob: the share of warm-start solutions that call the calculator)."""
    grpo_steps: int = 30
    """GRPO rollout steps (one optimizer step each)."""
    grpo_lr: float = 2e-4
    """GRPO learning rate."""
    max_new_tokens: int = 48
    """Cap of each model turn (a tool call is about 30 tokens)."""
    max_tokens: int = 96
    """Cap of a whole conversation after the prompt (env.max_tokens)."""
    val_size: int = 100
    """Held-out validation problems per evaluation."""
    eval_every: int = 0
    """Validate every this many GRPO steps (0: at the start and the end only)."""
    progress: bool = False
    """Show progress bars."""
    reuse_sft: bool = False
    """Reuse a finished warm start found in OUT/sft (to try GRPO settings again)."""


def run_tool_proof(cfg: ToolProofConfig) -> dict:
    """Run it; returns accuracy and calls per answer before and after, and writes ``OUT/tool_proof.json``."""

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sft_dir, grpo_dir = out / "sft", out / "grpo"
    t0 = time.perf_counter()
    if not cfg.finished_warm_start(sft_dir):
        cfg.warm_start(sft_dir)
    t_sft = time.perf_counter() - t0
    calculator = EnvConfig(
        name="tool", tools=("calculator",), tool_format="plain", max_turns=2, max_tokens=cfg.max_tokens
    )
    config = cfg.grpo_config(sft_dir, env=calculator)
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
