"""Every CLI error a user can cause on the machine they run on (a tracker or vLLM not installed, the fast
engine asked for a model it cannot run, a CUDA device that is not there, torchrun with an engine that
cannot be split over ranks) ends in one line that names the fix, with exit status 2 and no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr.checks import resolve_config
from rlvr.cli import main as cli
from rlvr.config import ConfigError, EngineConfig, TrainConfig
from rlvr.machine import check_machine, cuda_device_problem

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = """\
model: {fresh: tiny, tokenizer_vocab_size: 300}
data: {train_source: "arith:steps=1,max_value=9", train_size: 8, val_split: validation, val_size: 2}
prompt: r1_zero
rollout: {n_prompts_per_rollout_batch: 2, group_size: 2, max_new_tokens: 4}
optim: {lr: 1e-3, gradient_accumulation_steps: 1}
log: {progress: false, val_samples: 0}
n_steps: 1
eval_every: 0
"""
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's case")


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rlvr ") and ": warning: " not in line]
    assert len(lines) == 1 and lines[0].startswith(f"rlvr {command}: "), err
    return lines[0]


@pytest.fixture()
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return path


@pytest.fixture()
def gpt2_dir(tmp_path, tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer.save_pretrained(tmp_path / "gpt2")
    (tmp_path / "q.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    return tmp_path / "gpt2"


def test_a_tracker_that_is_not_installed(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without it imports
    assert cli(["train", "--config", str(tiny), "--out", str(tmp_path / "r"), "--log.tensorboard"]) == 2
    assert "pip install 'rlvr[tensorboard]'" in one_line(capsys, "train")
    assert not (tmp_path / "r").exists()


def test_vllm_engine_without_vllm(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `vllm` executable on it
    assert cli(["train", "--config", str(tiny), "--out", str(tmp_path / "r"), "--engine.name", "vllm"]) == 2
    assert "pip install 'rlvr[vllm]'" in one_line(capsys, "train")


def test_fast_engine_on_a_gpt2(tiny, gpt2_dir, tmp_path, capsys):
    out = str(tmp_path / "e")
    assert (
        cli(
            ["eval", "--model", str(gpt2_dir), "--data", str(tmp_path / "q.jsonl"), "--engine", "hf-fast", "--out", out]
        )
        == 2
    )
    assert "not GPT2LMHeadModel; use engine.name: hf" in one_line(capsys, "eval")
    args = ["--model.fresh", "None", "--model.name_or_path", str(gpt2_dir), "--engine.name", "hf-fast"]
    assert cli(["train", "--config", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "r"), *args]) == 2
    assert "not GPT2LMHeadModel; use engine.name: hf" in one_line(capsys, "train")


@no_gpu
@pytest.mark.parametrize(
    "command,args,expect",
    [
        ("train", ["--policy_device", "cuda:0"], "policy_device cuda:0 but this machine has no CUDA device"),
        (
            "train",
            ["--engine.name", "hf-worker", "--engine.device", "cuda:1"],
            "engine.device cuda:1 but this machine has no CUDA device",
        ),
        ("eval", ["--device", "cuda:0"], "--device cuda:0 but this machine has no CUDA device"),
        ("sft", ["--device", "cuda"], "--device cuda but this machine has no CUDA device"),
    ],
)
def test_cuda_asked_on_a_cpu_machine(command, args, expect, tiny, gpt2_dir, tmp_path, capsys):
    common = {
        "train": ["--config", str(tiny)],
        "eval": ["--model", str(gpt2_dir), "--data", str(tmp_path / "q.jsonl")],
        "sft": ["--model", "tiny", "--steps", "1"],
    }[command]
    assert cli([command, *common, *args, "--out", str(tmp_path / "out")]) == 2
    assert expect in one_line(capsys, command)


def test_cuda_device_problems_by_hand():
    assert cuda_device_problem("policy_device", "cpu", 0) is None
    assert cuda_device_problem("policy_device", "cuda:0", 1) is None
    assert cuda_device_problem("engine.device", "cuda:1", 2) is None
    assert cuda_device_problem("engine.device", "cuda:1", 1) == (
        "engine.device cuda:1 but only cuda:0..cuda:0 are visible; set engine.device auto or a visible GPU"
    )
    assert cuda_device_problem("--device", "cuda", 0).startswith("--device cuda but this machine has no CUDA device")
    # the README's one-GPU setting passes on one GPU; the two-GPU config does not
    one_gpu = resolve_config(TrainConfig(policy_device="cuda:0"))
    check_machine(one_gpu, n_gpu=1)
    two_gpu = TrainConfig(policy_device="cuda:0", engine=EngineConfig(name="hf-worker", device="cuda:1"))
    with pytest.raises(ConfigError, match="engine.device cuda:1 but only cuda:0..cuda:0 are visible"):
        check_machine(two_gpu, n_gpu=1)


def test_torchrun_with_the_hf_worker_engine_is_one_line_per_rank(tiny, tmp_path):
    """Each rank that reaches the check says it in one line and exits 2; what follows is torchrun's own report.

    torchrun stops the other ranks as soon as one fails, so the slower rank may be stopped before it prints.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    args = ["-m", "rlvr", "train", "--config", str(tiny), "--out", str(tmp_path / "r"), "--engine.name", "hf-worker"]
    done = subprocess.run(torchrun + args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("rlvr train: ")]
    assert 1 <= len(ours) <= 2 and all(
        "engine.name=hf-worker" in line and "use engine.name hf" in line for line in ours
    )
    assert "exitcode  : 2" in done.stderr
    assert "/rlvr/" not in "".join(line for line in done.stderr.splitlines() if line.strip().startswith("File "))


def help_exit_code(argv: list[str]) -> int | str | None:
    """``--help`` ends some commands through SystemExit (tyro's) and returns 0 from others."""
    try:
        return cli(argv)
    except SystemExit as done:
        return done.code


@pytest.mark.parametrize(
    "command", ["train", "eval", "sft", "dpo", "demo", "export", "sft instruct", "eval --suite mmlu"]
)
def test_help_is_named_after_the_command(command, capsys):
    words = command.split()
    assert help_exit_code([*words, "--help"]) == 0
    usage = capsys.readouterr().out.strip().splitlines()[0]
    name = " ".join(w for w in words if not w.startswith("-") and w != "mmlu")
    assert usage.startswith(f"usage: rlvr {name} "), usage


def test_eval_help_points_to_the_suites(capsys):
    assert help_exit_code(["eval", "--help"]) == 0
    assert "rlvr eval --suite mmlu gsm8k alpaca_eval sst" in capsys.readouterr().out


def test_sft_column_error_names_its_own_flag_and_the_flag_works(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"problem": "1+1?", "solution": "1 + 1 = 2 #### 2"}\n')
    common = ["sft", "--model", "tiny", "--data", str(data), "--steps", "1", "--batch-size", "1", "--no-progress"]
    assert cli([*common, "--out", str(tmp_path / "a")]) == 2
    assert one_line(capsys, "sft").endswith(
        "no column 'question' (columns: problem, solution); set --question-field to one of them"
    )
    assert (
        cli([*common, "--question-field", "problem", "--answer-field", "solution", "--out", str(tmp_path / "b")]) == 0
    )
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_plugins_named_in_the_config_train_and_a_missing_one_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """docs/custom_estimator.md's single run: the estimator file named by ``--plugins``, selected by name."""
    monkeypatch.chdir(REPO)
    args = [
        "--plugins",
        "examples/my_estimator.py",
        "--algorithm.reweighting",
        "dual_clip",
        "--algorithm.cliprange",
        "0.2",
    ]
    assert cli(["train", "--config", str(tiny), "--out", str(tmp_path / "r"), *args]) == 0
    monkeypatch.chdir(tmp_path)  # the relative path no longer resolves
    assert cli(["train", "--resume", str(tmp_path / "r"), "--n_steps", "2"]) == 2
    assert "plugin file 'examples/my_estimator.py' not found" in one_line(capsys, "train")
