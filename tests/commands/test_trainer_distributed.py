"""``rlvr train`` over two ranks (``torchrun --nproc-per-node 2``, gloo on the CPU) against the same run in
one process: DDP on-policy and FSDP2 off-policy give the one-process metrics and final weights; a run
that crashes resumes to the uninterrupted result (DDP on two ranks, FSDP2 on one process); LoRA trains only its adapters,
under FSDP2 and DDP as in one process, and its merged export is a model that ``rlvr eval`` loads.

Each rank samples its own prompts with its own engine, and a prompt alone in an engine batch
(``engine.max_batch_size`` = ``group_size``) is sampled from its own seed, so the ranks' rollouts are the
one-process rollouts and everything downstream can be compared. Float32 throughout; the tolerance
(``RTOL``, ``ATOL``) covers the different order of the gradient sums across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr.commands.train import read_summary, train
from rlvr.config import load_config_file
from rlvr.training.metrics_log import read_metrics

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-4, 1e-5
COMPARED = (
    "train/reward",
    "train/pass@1",
    "train/pass@2",
    "train/response_length",
    "train/reward_std",
    "train/zero_adv_frac",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/n_updates",
    "lr",
)

REWARD = '''
import os
from pathlib import Path


def parity(response, ground_truth, **fields):
    """Right about half the time on random text, so groups have signal."""
    crash_after = os.environ.get("RLVR_TEST_CRASH_AFTER")  # a run directory whose step-2 dump ends the grader
    if crash_after and (Path(crash_after) / "rollouts" / "step_2.jsonl").exists():
        raise RuntimeError("planted grader crash")
    return float(len(response) % 2 == 0)


def parity_on_even_truths(response, ground_truth, **fields):
    """Parity where the ground truth has an even number of characters, else always 0 (no signal)."""
    return float(len(response) % 2 == 0) if len(ground_truth) % 2 == 0 else 0.0
'''


ECHO_ENV = '''
from rlvr.environments import ENVIRONMENTS, EnvStep, register_environment


class Echo:
    """Two model turns: after the first, the environment says " ok." (context, not trained on)."""

    stop = ("e",)

    def reset(self, row, messages):
        return messages

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) >= 2:
            return EnvStep(done=True)
        return EnvStep(messages=[{"role": "user", "content": " ok."}])


if "echo" not in ENVIRONMENTS:
    register_environment("echo", lambda config: Echo())
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    """A saved tiny OLMo-2, a small arithmetic data file, the reward file and a base config file."""
    from rlvr.modeling import build_model, small_olmo2_config

    root = tmp_path_factory.mktemp("dist")
    model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)
    model.save_pretrained(root / "model")
    tiny_tokenizer.save_pretrained(root / "model")
    rows = [{"question": f"What is {a} plus {a + 3}?", "answer": f"#### {2 * a + 3}"} for a in range(24)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    (root / "echo_env.py").write_text(ECHO_ENV)
    base = {
        "model": {"name_or_path": str(root / "model")},
        "data": {"train_source": str(root / "data.jsonl"), "train_size": 16, "val_size": 2},
        "prompt": "question_only",
        "reward": {"fn": f"{root / 'reward.py'}:parity"},
        "rollout": {"n_prompts_per_rollout_batch": 4, "group_size": 2, "max_new_tokens": 6},
        "optim": {"lr": 3e-3, "gradient_accumulation_steps": 2},
        "engine": {"name": "hf", "max_batch_size": 2},
        "log": {"progress": False, "engine_logprob_check_every": 1, "val_samples": 2},
        "n_steps": 3,
        "eval_every": 0,
        "dump_every": 1,
        "save_every": 1,
        "seed": 3,
    }
    return root, base


def _config_file(path: Path, base: dict, **sections) -> Path:
    cfg = json.loads(json.dumps(base))
    for name, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(name, {}).update(values)
        else:
            cfg[name] = values
    path.write_text(json.dumps(cfg))
    return path


def _torchrun(args: list[str], env_extra: dict | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        **(env_extra or {}),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run([*cmd, "-m", "rlvr", "train", *args], env=env, capture_output=True, text=True, timeout=900)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ckpt = (run_dir / "checkpoints" / "latest").resolve()
    return load_file(str(ckpt / "model" / "model.safetensors"))


def _assert_same_run(got: Path, want: Path, start: dict[str, torch.Tensor]) -> None:
    a, b = read_metrics(want / "metrics.jsonl"), read_metrics(got / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in COMPARED:
            if ra.get(key) is None:  # e.g. no entropy when every advantage of the step was zero
                assert rb.get(key) is None, (key, ra["step"])
            else:
                assert rb[key] == pytest.approx(ra[key], rel=RTOL, abs=ATOL), (key, ra["step"])
    wa, wb = _weights(want), _weights(got)
    assert set(wa) == set(wb)
    assert max(float((wa[n] - start[n]).abs().max()) for n in wa) > 1e-3, "training moved nothing"
    # AdamW divides each gradient by its own running magnitude, so an element whose gradient nearly
    # cancels takes the reduction order's relative error into a step-sized update: the weights are
    # compared to a hundredth of the updates' largest possible total (lr per step), not to float noise.
    saved = json.loads((want / "config.json").read_text())
    weight_atol = max(ATOL, 1e-2 * saved["optim"]["lr"] * saved["n_steps"])
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=RTOL, atol=weight_atol, msg=name)
    dumped = [json.loads(line) for line in (got / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (want / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert [(r["group"], r["response"]) for r in dumped] == [(r["group"], r["response"]) for r in reference]


def _start_weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "model" / "model.safetensors"))


def test_ddp_on_policy_two_ranks_equal_one_process_and_resume_on_two(setup, tmp_path):
    root, base = setup
    cfg = _config_file(tmp_path / "cfg.json", base)
    train(load_config_file(cfg), tmp_path / "one")
    proc = _torchrun(["--config", str(cfg), "--out", str(tmp_path / "two"), "--distributed.strategy", "ddp"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_same_run(tmp_path / "two", tmp_path / "one", _start_weights(root))
    assert read_summary(tmp_path / "two")["status"] == "finished"
    saved = json.loads((tmp_path / "two" / "config.json").read_text())
    assert saved["distributed"]["strategy"] == "ddp"

    # A crash in step 3 leaves the step-2 checkpoint (one-process layout, each rank's RNG state beside
    # it); two ranks resume it to the uninterrupted result.
    broken = tmp_path / "broken"
    ddp = ["--config", str(cfg), "--distributed.strategy", "ddp"]
    proc = _torchrun([*ddp, "--out", str(broken)], env_extra={"RLVR_TEST_CRASH_AFTER": str(broken)})
    assert proc.returncode != 0 and "planted grader crash" in proc.stderr
    step2 = broken / "checkpoints" / "step_000002"
    assert not (step2 / "sharded").exists() and (step2 / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in (step2 / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    proc = _torchrun(["--resume", str(broken)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_same_run(broken, tmp_path / "one", _start_weights(root))


def test_fsdp_off_policy_two_ranks_equal_one_process_and_resume_on_one(setup, tmp_path):
    root, base = setup
    off_policy = {
        "algorithm": {"reweighting": "ppo_clip"},
        "optim": {"lr": 3e-3, "gradient_accumulation_steps": 2, "train_batch_size": 4, "epochs_per_rollout_batch": 2},
    }
    cfg = _config_file(tmp_path / "cfg.json", base, **off_policy)
    train(load_config_file(cfg), tmp_path / "one")
    start = _start_weights(root)

    fsdp = ["--config", str(cfg), "--distributed.strategy", "fsdp"]
    proc = _torchrun([*fsdp, "--out", str(tmp_path / "two")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_same_run(tmp_path / "two", tmp_path / "one", start)
    assert (tmp_path / "two" / "checkpoints" / "step_000003" / "sharded").is_dir()

    # A crash in step 3 on both ranks leaves the checkpoint of step 2, which one process resumes.
    broken = tmp_path / "broken"
    proc = _torchrun([*fsdp, "--out", str(broken)], env_extra={"RLVR_TEST_CRASH_AFTER": str(broken)})
    assert proc.returncode != 0
    assert "planted grader crash" in proc.stderr
    assert (broken / "checkpoints" / "latest").resolve().name == "step_000002"
    assert read_summary(broken)["status"] == "failed"
    assert sorted(p.name for p in (broken / "checkpoints" / "step_000002" / "rng").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
    ]
    from rlvr.commands.train import main

    assert main(["--resume", str(broken)]) == 0  # one process: an FSDP2 group of one
    _assert_same_run(broken, tmp_path / "one", start)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_lora_over_two_ranks_equals_one_process_and_exports_a_model_eval_loads(strategy, setup, tmp_path):
    from safetensors.torch import load_file

    root, base = setup
    lora = {
        "model": {
            "name_or_path": str(root / "model"),
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
        }
    }
    cfg = _config_file(tmp_path / "cfg.json", base, optim={"lr": 3e-2, "gradient_accumulation_steps": 2}, **lora)
    train(load_config_file(cfg), tmp_path / "one")
    # With gradient checkpointing too (recomputation changes no number): under FSDP2 the wrapper's own.
    args = ["--distributed.strategy", strategy, "--model.gradient_checkpointing"]
    proc = _torchrun(["--config", str(cfg), "--out", str(tmp_path / "two"), *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    start = _start_weights(root)
    _assert_same_run(tmp_path / "two", tmp_path / "one", start)

    ckpt = tmp_path / "one" / "checkpoints" / "step_000003"
    merged = load_file(str(ckpt / "model" / "model.safetensors"))
    assert set(merged) == set(start)  # plain names, no adapter tensors
    moved = {n for n in merged if not torch.equal(merged[n], start[n])}
    assert moved and all(any(t in n for t in ("q_proj", "v_proj", "up_proj")) for n in moved), sorted(moved)

    # The adapters the two ranks wrote (gathered from shards under FSDP2) load with peft onto the base
    # and give the merged model's logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    written = tmp_path / "two" / "checkpoints" / "step_000003"
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), written / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(written / "model")
    ids = torch.randint(2, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            adapted.eval()(input_ids=ids).logits, plain.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )

    from rlvr.cli import main

    out = tmp_path / "eval"
    rc = main(
        ["eval", "--model", str(ckpt / "model"), "--data", str(root / "data.jsonl"), "--split", "train"]
        + ["--prompt", "question_only", "--limit", "2", "--max-tokens", "4", "--device", "cpu", "--out", str(out)]
    )
    assert rc == 0 and (out / "results.json").is_file()


KNOBS = {
    # KL in the loss against a reference sharded like the policy (FSDP2), an entropy bonus, clip-higher,
    # off-policy (two updates a step)
    "fsdp_kl_loss_entropy": (
        "fsdp",
        {
            "algorithm": {"reweighting": "ppo_clip", "cliprange_high": 0.28, "kl_coef": 0.5, "entropy_coef": 0.01},
            "optim": {"lr": 3e-3, "gradient_accumulation_steps": 2, "train_batch_size": 4},
        },
        ("train/kl_ref", "train/clip_fraction"),
    ),
    # KL in the reward with a LoRA policy (the reference: its adapters off), DDP, the rloo preset
    "ddp_lora_kl_reward": (
        "ddp",
        {
            "algorithm": {"preset": "rloo", "kl_coef": 0.5, "kl_in": "reward", "kl_estimator": "k1"},
            "model": {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}},
            "optim": {"lr": 3e-2, "gradient_accumulation_steps": 2},
        },
        ("train/kl_penalty",),
    ),
    # DAPO's overlong filtering and soft penalty with its token-level loss, DDP; a stop string that random text reaches, so that
    # some responses stop and the others are cut
    "ddp_overlong": (
        "ddp",
        {
            "algorithm": {"mask_truncated": True, "loss_normalization": "token"},
            "reward": {"overlong_buffer": 3, "overlong_penalty": 0.5},
            "prompt_options": {"stop": ["e"]},
        },
        ("train/overlong_penalty", "train/truncated_frac"),
    ),
    # multi-turn conversations (an environment that answers once): each rank plays its own rows' turns
    "ddp_conversations": (
        "ddp",
        {"plugins": ["ROOT/echo_env.py"], "env": {"name": "echo", "max_turns": 2, "max_tokens": 16}},
        ("train/turns",),
    ),
    # dynamic sampling: every rank fills its own places, as one process does; FSDP2
    "fsdp_filter_groups": (
        "fsdp",
        {"rollout": {"filter_groups": True}, "reward": {"fn": "REWARD_FILE:parity_on_even_truths"}},
        ("rollout/filter_resampled", "rollout/filter_dropped", "rollout/filter_unfilled"),
    ),
}


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_knobs_over_two_ranks_equal_one_process(name, setup, tmp_path):
    root, base = setup
    strategy, sections, metrics = KNOBS[name]
    sections = json.loads(
        json.dumps(sections).replace("REWARD_FILE", str(root / "reward.py")).replace("ROOT", str(root))
    )
    cfg = _config_file(tmp_path / "cfg.json", base, **sections)
    train(load_config_file(cfg), tmp_path / "one")
    proc = _torchrun(["--config", str(cfg), "--out", str(tmp_path / "two"), "--distributed.strategy", strategy])
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_same_run(tmp_path / "two", tmp_path / "one", _start_weights(root))
    a, b = ([r for r in read_metrics(tmp_path / run / "metrics.jsonl") if r["step"] > 0] for run in ("one", "two"))
    for ra, rb in zip(a, b):
        for key in metrics:
            assert rb[key] == pytest.approx(ra[key], rel=RTOL, abs=ATOL), (key, ra["step"])
    assert any(r[metrics[0]] != 0 for r in a), "the knob did nothing"
