"""The CPU proof that instruction tuning and DPO each do their job, on the synthetic ``arith`` task.

For each seed:

1. **Data with a systematic flaw.** Each training problem of the task becomes a ``{prompt, response}``
   pair: the question, and a worked solution ``"7 + 5 = 12. 12 - 3 = 9. The answer is 9."``. In a
   set share of them (``flaw``) the last sentence restates the starting amount instead of the result
   (``"... The answer is 7."``): a wrong solution of the kind that slips into real SFT data, where an
   answer repeats a number from the question.
2. **SFT from a fresh model** (``rlvr sft instruct``'s loop: packed Alpaca-formatted documents, loss
   on every token) of a tiny OLMo-2 with a locally trained tokenizer. It learns much of the
   arithmetic and, imitating its data, often ends with the restated amount.
3. **Preference pairs built from the task**: for other training problems, the correct solution
   (chosen) against the same solution ending in the restated amount (rejected).
4. **DPO** (``rlvr dpo``'s loop) from the SFT model, with 200 held-out pairs for validation; the best
   checkpoint by validation preference accuracy is kept.
5. **Task accuracy** of the fresh model, the SFT model and the DPO model: greedy answers to 200
   held-out validation problems in fine-tuned mode (Alpaca template, stop at EOS), graded by the last
   number (``parse_gsm8k_response``), through ``rlvr.suites.run.run_suite``.

What the proof shows, plainly: SFT teaches the task from nothing, flaw included; DPO then removes a
decision the SFT model half-makes (which number to give as the answer), and that alone raises task
accuracy. DPO teaches no arithmetic here: on this 0.2 M-parameter model its updates even make the
last computed result right less often than after SFT (``result_correct_*`` in ``proof.json``), a
side effect that the rise in accuracy outweighs. It is the preference-learning counterpart of
``rlvr demo``, where GRPO fixes a format that the warm start half-knows.
``tests/commands/test_learning_assistant.py`` runs this with its defaults and checks the bars of
``docs/learning.md``.

    python -m rlvr.experiments.sft_dpo_proof --out runs/sft_dpo_proof
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlvr.commands.dpo import DPOConfig, run_dpo
from rlvr.commands.sft_instruct import InstructSFTConfig, run_instruct_sft
from rlvr.engines import make_engine
from rlvr.modeling import fresh_model, load_model_and_tokenizer
from rlvr.suites.run import SUITES, Suite, run_suite
from rlvr.task.data import load_examples
from rlvr.training.metrics_log import read_metrics

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rlvr.task.data import Example


@dataclass
class ProofConfig:
    """SFT from a fresh model, then DPO on correct-vs-wrong pairs, on the arith task, for several seeds."""

    out: Path = Path("runs/sft_dpo_proof")
    """Run directory: seed_<k>/ (sft/, dpo/, data), proof.json, proof.png."""
    task: str = "arith:steps=1,max_value=6"
    """The synthetic task (train split for SFT and pairs, validation split for accuracy)."""
    flaw: float = 0.6
    """Share of SFT responses that restate the starting amount as the answer."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds: each one trains its own SFT model and DPO run."""
    model_size: str = "tiny"
    """Size of the fresh OLMo-2 (rlvr.modeling.MODEL_SIZES)."""
    vocab_size: int = 640
    """Vocabulary of the locally trained tokenizer."""
    sft_examples: int = 4000
    """Training problems for SFT."""
    sft_steps: int = 200
    """SFT optimizer steps."""
    sft_lr: float = 1e-2
    """SFT peak learning rate (cosine, 3 % warm-up)."""
    sft_batch: int = 32
    """Packed windows per SFT step."""
    seq_length: int = 64
    """Tokens per packed window."""
    pair_problems: int = 600
    """Training problems (after the SFT ones) turned into preference pairs; 200 of the pairs are held out."""
    dpo_val_pairs: int = 200
    """Held-out pairs for validation preference accuracy."""
    dpo_lr: float = 1e-4
    """DPO learning rate (RMSprop)."""
    dpo_beta: float = 0.1
    """DPO beta."""
    dpo_batch: int = 16
    """Pairs per DPO optimizer step."""
    dpo_pairs_per_forward: int = 16
    """Pairs per forward in DPO (short sequences: one forward for the whole step)."""
    dpo_epochs: float = 1.0
    """Passes over the training pairs."""
    dpo_eval_every: int = 5
    """Validate every this many DPO steps."""
    val_problems: int = 200
    """Held-out validation problems for task accuracy."""
    max_new_tokens: int = 32
    """Answer cap (a full answer is about 15 tokens)."""
    progress: bool = False
    """Show progress bars."""


def worked_solution(example: Example, answer: str | None = None) -> str:
    """``"7 + 5 = 12. 12 - 3 = 9. The answer is 9."`` for an arith example (``answer`` replaces the final number)."""
    values = example.meta["values"]
    steps = " ".join(f"{a} {op} {k} = {b}." for (op, k), a, b in zip(example.meta["ops"], values, values[1:]))
    return f"{steps} The answer is {example.ground_truth if answer is None else answer}."


def restated(example: Example) -> str | None:
    """The flawed solution (the starting amount as the answer), or None where it would be right."""
    start = str(example.meta["start"])
    return None if start == example.ground_truth else worked_solution(example, start)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def task_accuracy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, problems: list[Example], max_new_tokens: int
) -> dict:
    """Greedy accuracy on ``problems`` in fine-tuned mode; how often the answer restates the start; how
    often the last computed result (before "The answer is") is right, whatever the answer says."""

    suite = Suite("arith", "", lambda ex: ex["question"], SUITES["gsm8k"].grade)
    rows = [{"question": ex.question, "answer": ex.ground_truth, "start": str(ex.meta["start"])} for ex in problems]
    metrics, samples = run_suite(
        suite, rows, make_engine("hf", model, tokenizer, max_batch_size=256), "finetuned", max_new_tokens
    )
    results = [re.search(r"= (-?\d+)\. The answer is", s["output"]) for s in samples]
    return {
        "accuracy": metrics["accuracy"],
        "restated_start": sum(s["parsed"] == s["start"] for s in samples) / len(samples),
        "result_correct": sum(m is not None and m.group(1) == s["answer"] for m, s in zip(results, samples))
        / len(samples),
        "example": samples[0]["output"],
    }


def run_seed(cfg: ProofConfig, seed: int) -> dict:

    out = Path(cfg.out) / f"seed_{seed}"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    problems = load_examples(cfg.task, "train", limit=cfg.sft_examples + cfg.pair_problems, seed=seed)
    sft_problems, pair_problems = problems[: cfg.sft_examples], problems[cfg.sft_examples :]
    sft_rows = []
    for ex in sft_problems:
        wrong = restated(ex) if rng.random() < cfg.flaw else None
        sft_rows.append({"prompt": ex.question, "response": wrong or worked_solution(ex)})
    pairs = [
        {"prompt": ex.question, "chosen": worked_solution(ex), "rejected": restated(ex)}
        for ex in pair_problems
        if restated(ex) is not None
    ]
    val = load_examples(cfg.task, "validation", limit=cfg.val_problems, seed=seed)

    t0 = time.perf_counter()
    sft_dir = run_instruct_sft(
        InstructSFTConfig(
            data=str(_write_jsonl(out / "sft.jsonl", sft_rows)),
            model=cfg.model_size,
            out=out / "sft",
            seq_length=cfg.seq_length,
            batch_size=cfg.sft_batch,
            lr=cfg.sft_lr,
            steps=cfg.sft_steps,
            val_size=64,
            eval_every=0,
            seed=seed,
            vocab_size=cfg.vocab_size,
            max_tokens_per_microbatch=cfg.sft_batch * cfg.seq_length,
            device="cpu",
            progress=cfg.progress,
            overwrite=True,
        )
    )
    t_sft = time.perf_counter() - t0
    sft_model, tokenizer = load_model_and_tokenizer(sft_dir)
    fresh = fresh_model(
        cfg.model_size, tokenizer, seed=seed, max_position_embeddings=sft_model.config.max_position_embeddings
    )
    acc_fresh = task_accuracy(fresh, tokenizer, val, cfg.max_new_tokens)
    acc_sft = task_accuracy(sft_model, tokenizer, val, cfg.max_new_tokens)

    t0 = time.perf_counter()
    dpo_dir = run_dpo(
        DPOConfig(
            model=str(sft_dir),
            data=(str(_write_jsonl(out / "pairs.jsonl", pairs)),),
            out=out / "dpo",
            val_size=cfg.dpo_val_pairs,
            beta=cfg.dpo_beta,
            lr=cfg.dpo_lr,
            batch_size=cfg.dpo_batch,
            epochs=cfg.dpo_epochs,
            eval_every=cfg.dpo_eval_every,
            save_every=0,
            seed=seed,
            device="cpu",
            progress=cfg.progress,
            overwrite=True,
            pairs_per_forward=cfg.dpo_pairs_per_forward,
            eval_batch_pairs=50,
        )
    )
    t_dpo = time.perf_counter() - t0
    dpo_model, _ = load_model_and_tokenizer(dpo_dir / "best")
    acc_dpo = task_accuracy(dpo_model, tokenizer, val, cfg.max_new_tokens)
    rows = read_metrics(dpo_dir / "metrics.jsonl")
    curve = [(r["step"], r["val/preference_accuracy"]) for r in rows if "val/preference_accuracy" in r]
    best = json.loads((dpo_dir / "best.json").read_text())
    return {
        "seed": seed,
        "accuracy_fresh": acc_fresh["accuracy"],
        "accuracy_sft": acc_sft["accuracy"],
        "accuracy_dpo": acc_dpo["accuracy"],
        "restated_sft": acc_sft["restated_start"],
        "result_correct_sft": acc_sft["result_correct"],
        "result_correct_dpo": acc_dpo["result_correct"],
        "restated_dpo": acc_dpo["restated_start"],
        "val_preference_accuracy": best["val/preference_accuracy"],
        "best_step": best["step"],
        "preference_curve": curve,
        "train_pairs": len(pairs) - cfg.dpo_val_pairs,
        "example_sft": acc_sft["example"],
        "example_dpo": acc_dpo["example"],
        "seconds_sft": t_sft,
        "seconds_dpo": t_dpo,
    }


def run_proof(cfg: ProofConfig) -> dict:
    """Run every seed; write ``OUT/proof.json`` and ``OUT/proof.png``; returns the summary."""
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    seeds = []
    for seed in cfg.seeds:
        seeds.append(run_seed(cfg, seed))
        r = seeds[-1]
        print(
            f"seed {seed}: task accuracy fresh {r['accuracy_fresh']:.3f} -> SFT {r['accuracy_sft']:.3f} -> DPO "
            f"{r['accuracy_dpo']:.3f}; validation preference accuracy {r['val_preference_accuracy']:.3f} "
            f"(step {r['best_step']}); SFT {r['seconds_sft']:.0f} s, DPO {r['seconds_dpo']:.0f} s",
            flush=True,
        )
    mean = lambda key: sum(s[key] for s in seeds) / len(seeds)  # noqa: E731
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "seeds": seeds,
        "mean": {
            k: mean(k)
            for k in (
                "accuracy_fresh",
                "accuracy_sft",
                "accuracy_dpo",
                "val_preference_accuracy",
                "restated_sft",
                "restated_dpo",
                "result_correct_sft",
                "result_correct_dpo",
            )
        },
    }
    (Path(cfg.out) / "proof.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, Path(cfg.out) / "proof.png")
    return summary


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = summary["seeds"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(seeds)
    stages = ("accuracy_fresh", "accuracy_sft", "accuracy_dpo")
    for i, s in enumerate(seeds):
        xs = [j + (i - (len(seeds) - 1) / 2) * width for j in range(len(stages))]
        ax1.bar(xs, [s[k] for k in stages], width, label=f"seed {s['seed']}")
    ax1.set_xticks(range(len(stages)), ["fresh model", "after SFT", "after DPO"])
    ax1.set(ylabel="task accuracy (greedy, held-out problems)", ylim=(0, 1), title="Task accuracy")
    ax1.legend()
    ax1.grid(axis="y", alpha=0.3)
    for s in seeds:
        steps, acc = zip(*s["preference_curve"])
        ax2.plot(steps, acc, "o-", label=f"seed {s['seed']}")
    ax2.axhline(0.9, color="gray", ls="--", lw=1)
    ax2.set(
        xlabel="DPO optimizer step",
        ylabel="share of held-out pairs ranked right",
        ylim=(0, 1.02),
        title="Validation preference accuracy",
    )
    ax2.legend(loc="lower right")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"SFT then DPO on {summary['config']['task']} ('{summary['config']['model_size']}' OLMo-2, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import tyro

    run_proof(tyro.cli(ProofConfig, args=argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
