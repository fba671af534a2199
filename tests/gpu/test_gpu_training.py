"""Training on a GPU: the compiled decoder-layer path equals eager (log-probs and gradients); one
`rlvr train` step runs with each in-process engine, and with ``hf-worker`` on a second GPU when there
is one; a warm-started model improves under a few GRPO steps with hf-fast (the learning smoke test)."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.config import (
    AlgorithmConfig,
    DataConfig,
    EngineConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
)
from rlvr.modeling import build_model, small_olmo2_config
from rlvr.training.logprobs import compile_backbone, get_response_log_probs
from rlvr.training.metrics_log import read_metrics
from rlvr.training.tokenize import tokenize_prompt_and_output

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TASK = "arith:steps=1,max_value=10"


def test_compiled_backbone_matches_eager(tiny_tokenizer):
    model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=192, num_layers=2, num_heads=4), seed=0)
    model = model.to("cuda").train()
    torch._dynamo.reset()
    backbone = compile_backbone(model)
    for prompts, responses in (
        (["What is 2+3?", "Say hi"], [" It is 5.", " hi hi hi"]),
        (["A longer question about apples?", "Q", "Why?"], [" 7", " it is 12 and more", " no"]),
    ):
        tok = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
        x, y = tok["input_ids"].cuda(), tok["labels"].cuda()
        w = torch.randn(y.shape, device="cuda")
        results = []
        for bb in (None, backbone):
            out = get_response_log_probs(model, x, y, True, backbone=bb)
            out["log_probs"].mul(w).sum().backward()
            results.append((out["log_probs"].detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (eager, g_eager), (comp, g_comp) = results
        torch.testing.assert_close(comp, eager, rtol=1e-3, atol=1e-4)
        for a, b in zip(g_comp, g_eager):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)
    torch._dynamo.reset()


def test_fused_head_weight_gradient_accumulates_in_float32_inside_the_matmul():
    """On CUDA the head's weight gradient is summed over chunks by a bf16 x bf16 -> float32 matmul.
    By hand as in tests/training/test_fused_logprobs.py: zero weights, every label 0, hidden 1; one token adds
    1.0 and 256 add 1/512 each to d/dW[0]: 1.5, which a bf16 running sum would leave at 1.0. Then random
    bf16 inputs over many chunks against the float64 gradient."""
    from rlvr.training.fused_logprobs import _addmm_into_float32, linear_log_probs

    assert _addmm_into_float32("cuda")
    n = 257
    hidden = torch.ones(n, 1, dtype=torch.bfloat16, device="cuda")
    weight = torch.zeros(2, 1, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    upstream = torch.full((n,), 1 / 256, device="cuda")
    upstream[0] = 2.0
    lp, _ = linear_log_probs(hidden, weight, None, torch.zeros(n, dtype=torch.long, device="cuda"), chunk_tokens=1)
    (grad_w,) = torch.autograd.grad((lp * upstream).sum(), (weight,))
    assert grad_w[:, 0].tolist() == [1.5, -1.5]

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 1000, 64, 512
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    weight = (0.1 * torch.randn(v, h, device="cuda", generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    upstream = torch.randn(n, device="cuda", generator=gen)
    lp, _ = linear_log_probs(hidden, weight, None, labels, chunk_tokens=64, compiled=True)
    (grad_w,) = torch.autograd.grad((lp * upstream).sum(), (weight,))
    w64 = weight.detach().double().requires_grad_()
    ref = torch.log_softmax(hidden.double() @ w64.t(), -1).gather(-1, labels[:, None]).squeeze(-1)
    (want,) = torch.autograd.grad((ref * upstream.double()).sum(), (w64,))
    torch.testing.assert_close(grad_w.double(), want, rtol=2e-2, atol=2e-2)


@pytest.fixture()
def tiny_model_dir(tmp_path, tiny_tokenizer):
    path = tmp_path / "model"
    model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=192, num_layers=2, num_heads=4), seed=0)
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def one_step_config(model_dir, engine: EngineConfig, compile_model: bool = False) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(name_or_path=str(model_dir), compile=compile_model),
        data=DataConfig(train_source=TASK, val_source=TASK, val_split="validation", val_size=8),
        prompt="r1_zero",
        algorithm=AlgorithmConfig(preset="grpo"),
        rollout=RolloutConfig(n_prompts_per_rollout_batch=4, group_size=4, max_new_tokens=16),
        optim=OptimConfig(lr=1e-4, gradient_accumulation_steps=1),
        engine=engine,
        log=LogConfig(progress=False, engine_logprob_check_every=1),
        n_steps=2,
        eval_every=2,
        save_every=2,
        policy_device="cuda:0",
    )


def coin(response: str, ground_truth: str) -> dict:
    r = float(hash(response) % 2)
    return {"reward": r, "answer_reward": r, "format_reward": 1.0}


@pytest.mark.parametrize("engine", ["hf", "hf-fast", "hf-fast+compile", "hf-worker"])
def test_rlvr_train_steps_with_each_engine(tmp_path, tiny_model_dir, engine):
    from rlvr.commands.train import train

    name, _, extra = engine.partition("+")
    device = "cuda:0"
    if name == "hf-worker":
        if torch.cuda.device_count() < 2:
            pytest.skip("hf-worker needs a second GPU (NCCL does not pair two ranks on one device)")
        device = "cuda:1"
    cfg = one_step_config(tiny_model_dir, EngineConfig(name=name, device=device), compile_model=extra == "compile")
    train(cfg, tmp_path / "run", reward_fn=coin)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        if "train/engine_logprob_diff" in r:
            assert r["train/engine_logprob_diff"] < 5e-2, r["train/engine_logprob_diff"]
    assert any("val/reward" in r for r in rows)
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_warm_start_then_grpo_learns(tmp_path):
    """The CPU demo's pipeline on the GPU with hf-fast: SFT warm start, then GRPO raises validation
    accuracy (by tens of points on the CPU; this asks for 15). float32, as on the CPU."""
    from rlvr.commands.demo import DemoConfig, run_demo

    result = run_demo(
        DemoConfig(
            out=tmp_path / "demo",
            device="cuda",
            engine="hf-fast",
            dtype="float32",
            grpo_steps=40,
            eval_every=20,
            progress=False,
        )
    )
    assert result["after"] >= result["before"] + 0.15, result


def test_rlvr_eval_with_hf_fast_on_the_gpu(tmp_path, tiny_model_dir):
    """`rlvr eval --engine hf-fast` on the GPU, with pass@k and avg@k for --n 4."""
    import json

    from rlvr.cli import main

    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--data",
                TASK,
                "--split",
                "validation",
                "--limit",
                "16",
                "--max-tokens",
                "16",
                "--n",
                "4",
                "--engine",
                "hf-fast",
                "--device",
                "cuda",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    m = json.loads((out / "results.json").read_text())["results"]["r1_zero"]
    assert m["n"] == 64 and set(m["pass_at_k"]) == {"1", "2", "4"}
    assert m["pass_at_k"]["1"] == pytest.approx(m["avg_at_k"])
