"""The README's chat example (examples/chat_arith) end to end on the CPU: SFT -> GRPO -> eval on one model
in one chat format, the README's three commands run as written with a tiny model's sizes appended."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from rlvr.cli import main

REPO = Path(__file__).resolve().parents[2]
# Each command as written, then a tiny model's sizes and a few steps (later flags win).
TINY = {
    "sft": ["--model", "tiny", "--vocab-size", "300", "--steps", "4", "--batch-size", "4", "--no-progress"],
    "train": [
        "--n_steps", "2", "--eval_every", "0", "--save_every", "0", "--dump_every", "1",
        "--data.train_size", "16", "--data.val_size", "4",
        "--rollout.n_prompts_per_rollout_batch", "2", "--rollout.group_size", "2", "--rollout.max_new_tokens", "8",
        "--log.no-progress", "--policy_device", "cpu",
    ],
    "eval": ["--limit", "3", "--max-tokens", "8", "--device", "cpu"],
}  # fmt: skip


def readme_commands() -> list[list[str]]:
    """The argument lists of the commands in the README's chat example section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("### One chat model in one chat format", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    return [shlex.split(line)[1:] for line in block.group(1).splitlines() if line.startswith("rlvr ")]


def test_sft_grpo_eval_on_one_chat_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    commands = readme_commands()
    assert [c[0] for c in commands] == ["sft", "train", "eval"]
    for argv in commands:
        assert main([*argv, *TINY[argv[0]]]) == 0, argv

    template = (REPO / "examples" / "chat_arith" / "chat.jinja").read_text()
    from transformers import AutoTokenizer

    sft_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "runs" / "chat-sft")
    assert sft_tokenizer.chat_template == template
    system = "Solve the problem step by step, then close with </think> <answer> the number </answer>."
    opening = f"<|system|>\n{system}\n<|user|>\n"
    # GRPO sampled from prompts in the chat format: system turn, the problem as the user's, the assistant's header
    dumped = (tmp_path / "runs" / "chat-grpo" / "rollouts").glob("step_*.jsonl")
    prompts = [json.loads(line)["prompt"] for path in dumped for line in path.read_text().splitlines()]
    assert prompts and all(p.startswith(opening) and p.endswith("\n<|assistant|>\n") for p in prompts)
    # and eval in the same one
    samples = [
        json.loads(line) for line in (tmp_path / "runs" / "chat-eval" / "samples.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 3
    for s in samples:
        assert s["prompt"] == f"{opening}{s['question']}\n<|assistant|>\n"
