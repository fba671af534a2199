"""CPU runs of the standard RLVR knobs through ``rlvr train`` on a tiny random OLMo-2: with each knob
on, a run trains (the weights move, the knob's metric is logged) and a run that crashes in its last
step resumes to exactly the uninterrupted result (metrics and weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlvr.checks import resolve_config
from rlvr.commands.train import train
from rlvr.config import (
    AlgorithmConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PromptOptions,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from rlvr.errors import GraderError
from rlvr.training.checkpoint import latest_checkpoint
from rlvr.training.metrics_log import read_metrics


def parity_reward(response: str, ground_truth: str) -> dict:
    """Right about half the time on random text, so groups have signal."""
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": 1.0}


def fresh_model(tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    return build_model(small_olmo2_config(tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)


def knob_config(gsm8k_path, **sections) -> TrainConfig:
    base = {
        "data": DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=0),
        "rollout": RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
        "optim": OptimConfig(lr=3e-3, train_batch_size=4, gradient_accumulation_steps=2),
        "log": LogConfig(progress=False, val_samples=0),
    }
    base.update(sections)
    return TrainConfig(prompt="question_only", n_steps=3, eval_every=0, dump_every=0, save_every=2, **base)


def _strip_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "mem/"))} for r in rows]


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(latest_checkpoint(run_dir) / "model" / "model.safetensors"))


def trains_and_resumes_exactly(
    cfg: TrainConfig, tokenizer, tmp_path, reward=parity_reward, model_given: bool = True
) -> list[dict]:
    """Run ``cfg`` straight, and again with a grader crash in its last step then ``--resume``; assert
    the same metrics and final weights, and that training moved the weights. The model is passed in
    (a fresh one each time: on resume the checkpoint's weights come on top), or with
    ``model_given=False`` loaded from ``cfg.model``. Returns the straight run's step metrics."""

    def model_args() -> dict:
        return {"model": fresh_model(tokenizer), "tokenizer": tokenizer} if model_given else {}

    cfg = dataclasses.replace(cfg, dump_every=1)  # the last step but one's dump arms the crash
    train(cfg, tmp_path / "straight", reward_fn=reward, **model_args())
    broken = tmp_path / "broken"
    armed = broken / "rollouts" / f"step_{cfg.n_steps - 1}.jsonl"
    resumed = {"now": False}

    def crashes_in_the_last_step(response, gt):
        if armed.exists() and not resumed["now"]:
            raise ValueError("grader bug")
        return reward(response, gt)

    with pytest.raises(GraderError):
        train(cfg, broken, reward_fn=crashes_in_the_last_step, **model_args())
    assert latest_checkpoint(broken).name == "step_000002"
    resumed["now"] = True
    train(cfg, broken, resume=True, reward_fn=crashes_in_the_last_step, **model_args())
    a, b = read_metrics(tmp_path / "straight" / "metrics.jsonl"), read_metrics(broken / "metrics.jsonl")
    assert _strip_timings(a) == _strip_timings(b)
    wa, wb = _final_weights(tmp_path / "straight"), _final_weights(broken)
    start = fresh_model(tokenizer).state_dict()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert any(not torch.equal(wa[n], start[n]) for n in wa if n in start), "training moved nothing"
    return [r for r in a if r["step"] > 0]


@pytest.mark.slow
def test_clip_higher_and_rloo_train_and_resume(gsm8k_path, tiny_tokenizer, tmp_path):
    algorithm = AlgorithmConfig(preset="rloo", reweighting="ppo_clip", cliprange_low=0.2, cliprange_high=0.28)
    rows = trains_and_resumes_exactly(knob_config(gsm8k_path, algorithm=algorithm), tiny_tokenizer, tmp_path)
    assert all(0 <= r["train/clip_fraction"] <= 1 for r in rows)


@pytest.mark.slow
def test_kl_in_the_loss_is_zero_at_the_start_grows_and_resumes(gsm8k_path, tiny_tokenizer, tmp_path):
    algorithm = AlgorithmConfig(kl_coef=0.5, kl_estimator="k3")
    optim = OptimConfig(lr=3e-3, gradient_accumulation_steps=2)  # one update per step: step 1 is the reference
    rows = trains_and_resumes_exactly(
        knob_config(gsm8k_path, algorithm=algorithm, optim=optim), tiny_tokenizer, tmp_path
    )
    kl = [r["train/kl_ref"] for r in rows]
    assert kl[0] == 0.0 and kl[1] > 0 and kl[2] > 0, kl


@pytest.mark.slow
def test_kl_in_the_reward_resumes_with_the_reference_reloaded_from_the_model_source(
    gsm8k_path, tiny_tokenizer, tmp_path
):
    model_dir = tmp_path / "model"
    fresh_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    cfg = knob_config(
        gsm8k_path,
        model=ModelConfig(name_or_path=str(model_dir)),
        algorithm=AlgorithmConfig(kl_coef=0.5, kl_estimator="k1", kl_in="reward"),
        optim=OptimConfig(lr=3e-3, gradient_accumulation_steps=2),
    )
    rows = trains_and_resumes_exactly(cfg, tiny_tokenizer, tmp_path / "runs", model_given=False)
    assert rows[0]["train/kl_ref"] == 0.0 and rows[0]["train/kl_penalty"] == 0.0
    assert rows[1]["train/kl_ref"] != 0.0 and rows[2]["train/kl_penalty"] != 0.0


@pytest.mark.slow
def test_entropy_bonus_trains_and_resumes(gsm8k_path, tiny_tokenizer, tmp_path):
    rows = trains_and_resumes_exactly(
        knob_config(gsm8k_path, algorithm=AlgorithmConfig(entropy_coef=0.05)), tiny_tokenizer, tmp_path
    )
    assert all(r["train/entropy"] > 0 for r in rows)


@pytest.mark.slow
def test_overlong_filtering_and_soft_penalty_train_and_resume(gsm8k_path, tiny_tokenizer, tmp_path):
    import json

    # A stop string that random text often reaches: some responses stop, the others are cut at 6 tokens.
    cfg = knob_config(
        gsm8k_path,
        algorithm=AlgorithmConfig(mask_truncated=True, loss_normalization="token"),  # DAPO's, with its token-level loss
        reward=RewardConfig(overlong_buffer=3, overlong_penalty=0.5),
        prompt_options=PromptOptions(stop=("e",)),
        rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
    )
    rows = trains_and_resumes_exactly(cfg, tiny_tokenizer, tmp_path)
    assert any(0 < r["train/truncated_frac"] < 1 for r in rows)
    assert all(-0.5 <= r["train/overlong_penalty"] <= 0 for r in rows)
    assert any(r["train/overlong_penalty"] < 0 for r in rows)
    dumped = [
        json.loads(line) for line in (tmp_path / "straight" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    ]
    cut = [d for d in dumped if d["finish_reason"] == "length"]
    assert cut and all(d["n_train_tokens"] == 0 and d["advantage"] == 0 for d in cut)
    assert any(d["n_train_tokens"] > 0 for d in dumped if d["finish_reason"] != "length")


def parity_on_even_truths(response: str, ground_truth: str) -> dict:
    """Parity where the ground truth has an even number of characters, else always 0: the groups of the
    other prompts carry no signal, for dynamic sampling to replace."""
    r = float(len(response) % 2 == 0) if len(ground_truth) % 2 == 0 else 0.0
    return {"reward": r, "answer_reward": r, "format_reward": 1.0}


def test_signal_free_groups():
    from rlvr.commands.train import _signal_free

    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0])
    assert _signal_free(rewards, 3) == [True, False, True, False]


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_and_resumes(gsm8k_path, tiny_tokenizer, tmp_path):
    import json

    cfg = knob_config(
        gsm8k_path,
        rollout=RolloutConfig(n_prompts_per_rollout_batch=4, group_size=4, max_new_tokens=6, filter_groups=True),
        optim=OptimConfig(lr=3e-3, gradient_accumulation_steps=2),
    )
    rows = trains_and_resumes_exactly(cfg, tiny_tokenizer, tmp_path, reward=parity_on_even_truths)
    assert sum(r["rollout/filter_resampled"] for r in rows) > 0
    for r in rows:
        # every place still without signal after the rounds is a zero-advantage group, and only those
        assert r["train/zero_adv_frac"] * 4 == pytest.approx(r["rollout/filter_unfilled"])
        assert r["rollout/filter_dropped"] >= r["rollout/filter_unfilled"]
        assert r["rollout/filter_rounds"] <= 3
    from rlvr.commands.train import _rollout_request

    filled = next(r["step"] for r in rows if r["rollout/filter_resampled"] > 0)
    dumped = [
        json.loads(x) for x in (tmp_path / "straight" / "rollouts" / f"step_{filled}.jsonl").read_text().splitlines()
    ]
    sampled_first = _rollout_request(cfg, _train_examples(cfg))(filled)[0]
    assert [d["prompt"] for d in dumped[::4]] != sampled_first  # a group was replaced


def _train_examples(cfg: TrainConfig):
    from rlvr.task.build import load_task_data

    return load_task_data(resolve_config(cfg))[0]


@pytest.mark.slow
def test_kl_under_lora_uses_the_adapters_off_policy_and_resumes(gsm8k_path, tiny_tokenizer, tmp_path):
    from rlvr.config import LoraConfig

    cfg = knob_config(
        gsm8k_path,
        model=ModelConfig(lora=LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))),
        algorithm=AlgorithmConfig(kl_coef=0.5),
        optim=OptimConfig(lr=3e-2, gradient_accumulation_steps=2),
    )
    rows = trains_and_resumes_exactly(cfg, tiny_tokenizer, tmp_path)
    kl = [r["train/kl_ref"] for r in rows]
    assert kl[0] == 0.0 and kl[2] > 0, kl  # the adapters start at zero: the policy is its base model
