"""CPU tests of the training loop on a tiny random OLMo-2: every preset and reweighting method writes
sane metrics; resume equals an uninterrupted run; faults (NaN, grader, engine, Ctrl-C) stop or skip
as documented; old log-probs are computed once per rollout batch."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import rlvr.commands.train as trainer_mod
from rlvr.checks import resolve_config, validate_config
from rlvr.commands.train import EngineError, GraderError, NonFiniteError, read_summary, train
from rlvr.config import AlgorithmConfig, DataConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
from rlvr.task.data_order import batch_indices
from rlvr.training.checkpoint import latest_checkpoint, load_model_weights
from rlvr.training.metrics_log import read_metrics
from rlvr.training.scaffold import TrainCallback

REQUIRED = [
    "step",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/reward",
    "train/format_reward",
    "train/response_length",
    "train/zero_adv_frac",
    "train/pass@1",
    "train/pass@2",
    "train/pass@4",
    "lr",
    "time/generate",
    "time/train",
    "time/sync",
    "tokens_per_s",
]


def parity_reward(response: str, ground_truth: str) -> dict:
    """Right about half the time on random text, so groups have signal; format = has a space."""
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": float(" " in response)}


def tiny_config(gsm8k_path, n_steps=2, **overrides) -> TrainConfig:
    sections = {
        "data": DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2),
        "rollout": RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
        "optim": OptimConfig(lr=1e-3, gradient_accumulation_steps=2),
        "log": LogConfig(progress=False, engine_logprob_check_every=1, val_samples=2),
    }
    for key in list(overrides):
        if key in sections:
            sections[key] = overrides.pop(key)
    base = dict(prompt="question_only", n_steps=n_steps, eval_every=0, dump_every=1, save_every=0, **sections)
    base.update(overrides)
    return TrainConfig(**base)


def run(cfg, out, tiny_model, tiny_tokenizer, resume=False, reward_fn=parity_reward, **kw):
    return train(cfg, out, resume=resume, model=tiny_model, tokenizer=tiny_tokenizer, reward_fn=reward_fn, **kw)


def check_sane(rows, group_size=4, clipping=False):
    steps = [r for r in rows if r["step"] > 0]
    assert steps, "no training steps logged"
    for r in steps:
        for key in REQUIRED:
            if key == "train/entropy" and r.get("train/zero_adv_frac") == 1:
                continue  # every advantage was zero: no sequence went through the update, so none was measured
            assert key in r, f"{key} missing at step {r['step']}"
            assert r[key] is not None and math.isfinite(r[key]), f"{key}={r[key]} at step {r['step']}"
        assert 0 <= r["train/reward"] <= 1 and 0 <= r["train/format_reward"] <= 1
        assert 0 <= r["train/zero_adv_frac"] <= 1
        pk = [r[f"train/pass@{k}"] for k in (1, 2, 4)]
        assert all(0 <= p <= 1 for p in pk) and pk == sorted(pk), pk
        assert r["train/pass@1"] == pytest.approx(r["train/reward"])
        assert r["train/grad_norm"] >= 0 and (r["train/zero_adv_frac"] == 1 or r["train/entropy"] > 0)
        assert r["train/skipped_nonfinite"] == 0
        if clipping:
            assert 0 <= r["train/clip_fraction"] <= 1
        else:
            assert "train/clip_fraction" not in r
        if "train/engine_logprob_diff" in r:  # same weights, same float32 maths: tiny difference
            assert 0 <= r["train/engine_logprob_diff"] < 1e-3
        assert 0 <= r["train/engine_token_match_frac"] <= 1


@pytest.mark.parametrize("preset", ["grpo", "grpo_constant", "dr_grpo", "rft", "maxrl"])
def test_every_preset_writes_sane_metrics(preset, gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    cfg = tiny_config(gsm8k_path, algorithm=AlgorithmConfig(preset=preset))
    before = [p.detach().clone() for p in tiny_model.parameters()]
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    check_sane(rows)
    assert all(r["train/n_updates"] == 1 for r in rows[1:])  # on-policy: one optimizer step per rollout batch
    moved = any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    assert moved == any(r["train/zero_adv_frac"] < 1 for r in rows[1:])
    summary = read_summary(tmp_path)
    assert summary["status"] == "finished" and summary["step"] == 2
    assert set(summary["final"]) >= {"val/reward", "val/format_reward", "val/response_length"}
    assert rows[-1]["val/reward"] == summary["final"]["val/reward"]
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert resolved["algorithm"]["baseline"] is not None and resolved["optim"]["train_batch_size"] == 8
    dump = [json.loads(line) for line in (tmp_path / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(dump) == 8 and all(d["reward"] == parity_reward(d["response"], "")["reward"] for d in dump)


@pytest.mark.parametrize("method", ["noclip", "grpo", "gspo", "cispo"])
def test_every_reweighting_off_policy(method, gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    calls = []
    real = trainer_mod.compute_log_probs_batched
    monkeypatch.setattr(trainer_mod, "compute_log_probs_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_config(
        gsm8k_path,
        algorithm=AlgorithmConfig(preset="dr_grpo", reweighting=method),
        optim=OptimConfig(
            lr=3e-3, train_batch_size=4, gradient_accumulation_steps=2, epochs_per_rollout_batch=2, logprob_batch_size=8
        ),
    )
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    check_sane(rows, clipping=method != "noclip")
    assert all(r["train/n_updates"] == 4 for r in rows[1:])  # 2 epochs x (8 rollouts / 4)
    assert len(calls) == 2  # old log-probs once per rollout batch, not per update
    # Old log-probs come from the sampling weights, so they equal the engine's sampling log-probs.
    assert all("train/engine_logprob_diff" in r for r in rows[1:] if r["train/engine_token_match_frac"] > 0)


def test_on_policy_skips_the_old_log_prob_forward(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(trainer_mod, "compute_log_probs_batched", lambda *a, **k: calls.append(1))
    cfg = tiny_config(gsm8k_path, log=LogConfig(progress=False, engine_logprob_check_every=0))
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    assert calls == []


def test_batch_indices_walk_seeded_epochs():
    n, p = 10, 4
    stream = [i for s in range(5) for i in batch_indices(n, p, s, seed=3)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]  # a fresh permutation per epoch
    assert batch_indices(n, p, 2, seed=3) == stream[8:12]  # a pure function of (seed, step)
    assert batch_indices(n, p, 0, seed=4) != batch_indices(n, p, 0, seed=3)


def _strip_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "mem/"))} for r in rows]


def test_resume_equals_uninterrupted(gsm8k_path, tiny_tokenizer, tmp_path):
    from rlvr.modeling import build_model, small_olmo2_config

    def fresh():
        return build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)

    cfg = tiny_config(
        gsm8k_path,
        n_steps=4,
        save_every=2,
        eval_every=2,
        algorithm=AlgorithmConfig(preset="grpo", reweighting="grpo"),
        optim=OptimConfig(
            lr=3e-3, train_batch_size=4, gradient_accumulation_steps=1, schedule="cosine", warmup_steps=1
        ),
    )
    straight = tmp_path / "straight"
    model_a = fresh()
    run(cfg, straight, model_a, tiny_tokenizer)

    calls = {"n": 0}

    def crashes_in_step_4(response, gt):  # 8 rollouts per step: call 25 is the first of step 4
        calls["n"] += 1
        if calls["n"] > 24:
            raise ValueError("grader bug")
        return parity_reward(response, gt)

    broken = tmp_path / "broken"
    with pytest.raises(GraderError, match="reward function failed at step 4"):
        run(cfg, broken, fresh(), tiny_tokenizer, reward_fn=crashes_in_step_4)
    assert [r["step"] for r in read_metrics(broken / "metrics.jsonl")] == [0, 1, 2, 3]
    assert latest_checkpoint(broken).name == "step_000002"
    assert read_summary(broken)["status"] == "failed"

    model_b = fresh()  # resumed with a fresh model object: the weights must come from the checkpoint
    run(cfg, broken, model_b, tiny_tokenizer, resume=True)
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(broken / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert _strip_timings(a) == _strip_timings(b)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    assert read_summary(broken)["status"] == "finished"
    # A finished run is skipped on resume (nothing reruns, nothing is appended).
    run(cfg, broken, fresh(), tiny_tokenizer, resume=True)
    assert len(read_metrics(broken / "metrics.jsonl")) == 5


def test_packed_run_equals_padded_run(gsm8k_path, tiny_tokenizer, tmp_path):
    """``optim.shared_prefix`` through ``rlvr train``: three steps (PPO clipping, a token budget) with the
    same rewards, losses, gradient norms and entropies as the padded run, the same weights after, and
    fewer tokens through the model."""
    from rlvr.modeling import build_model, small_olmo2_config

    runs = {}
    for shared in (False, True):
        cfg = tiny_config(
            gsm8k_path,
            n_steps=3,
            algorithm=AlgorithmConfig(preset="grpo", reweighting="grpo"),
            optim=OptimConfig(
                lr=3e-3, gradient_accumulation_steps=1, max_tokens_per_microbatch=400, shared_prefix=shared
            ),
        )
        model = build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)
        run(cfg, tmp_path / str(shared), model, tiny_tokenizer)
        rows = [r for r in read_metrics(tmp_path / str(shared) / "metrics.jsonl") if r["step"] > 0]
        runs[shared] = (rows, [p.detach().clone() for p in model.parameters()])
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    assert len(packed) == len(padded) == 3
    for a, b in zip(padded, packed, strict=True):
        for key in ("train/reward", "train/loss", "train/grad_norm", "train/entropy", "train/clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        assert 0 < b["train/backbone_tokens"] < a["train/backbone_tokens"]
    # Adam divides each gradient entry by its own running scale, which magnifies rounding differences
    # of entries near zero: a small fraction of an lr-sized step is allowed.
    for a, b in zip(w_padded, w_packed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # lr 3e-3: a thirtieth of a step


def test_existing_run_needs_resume(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    from rlvr.config import ConfigError

    cfg = tiny_config(gsm8k_path, n_steps=1)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    with pytest.raises(ConfigError, match="already holds a run"):
        run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    with pytest.raises(ConfigError, match="rollout.group_size"):
        run(
            tiny_config(
                gsm8k_path,
                n_steps=2,
                rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=2, max_new_tokens=6),
            ),
            tmp_path,
            tiny_model,
            tiny_tokenizer,
            resume=True,
        )


def _nan_updates(monkeypatch, bad_calls):
    """Make the listed (1-based) policy_gradient_update calls see NaN advantages."""
    real = trainer_mod.policy_gradient_update
    count = {"n": 0}

    def planted(model, optimizer, batch, *args, **kwargs):
        count["n"] += 1
        if count["n"] in bad_calls:
            batch = dataclasses.replace(batch, advantages=torch.full_like(batch.advantages, float("nan")))
        return real(model, optimizer, batch, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "policy_gradient_update", planted)


def test_callbacks_see_every_step_in_order_and_a_resume_goes_on(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    calls = []

    class Record(TrainCallback):
        def on_step_begin(self, step, run_dir):
            calls.append(("begin", step, run_dir))

        def on_step_end(self, step, run_dir, metrics):
            calls.append(("end", step, metrics["step"], (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()))

    class StopBeforeStep3(TrainCallback):
        def on_step_begin(self, step, run_dir):
            if step == 3 and not resumed:
                raise KeyboardInterrupt  # as Ctrl-C: step 2, the last whole step, is saved

    cfg = tiny_config(gsm8k_path, n_steps=4, save_every=2)
    resumed = False
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path, tiny_model, tiny_tokenizer, callbacks=[Record(), StopBeforeStep3()])
    resumed = True
    run(cfg, tmp_path, tiny_model, tiny_tokenizer, resume=True, callbacks=[Record(), StopBeforeStep3()])
    assert calls == [
        ("begin", 1, tmp_path),
        ("end", 1, 1, False),
        ("begin", 2, tmp_path),
        ("end", 2, 2, True),  # the checkpoint that was due is written before the hook
        ("begin", 3, tmp_path),  # the interrupted step: no end
        ("begin", 3, tmp_path),  # the resumed run starts again at step 3
        ("end", 3, 3, False),
        ("begin", 4, tmp_path),
        ("end", 4, 4, True),
    ]


def test_planted_nan_is_skipped_and_counted(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    _nan_updates(monkeypatch, bad_calls={2})
    cfg = tiny_config(gsm8k_path, n_steps=3)
    snapshots = []

    class WeightsBeforeEachStep(TrainCallback):
        def on_step_begin(self, step, run_dir):
            snapshots.append([p.detach().clone() for p in tiny_model.parameters()])

    run(cfg, tmp_path, tiny_model, tiny_tokenizer, callbacks=[WeightsBeforeEachStep()])
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert [r["train/skipped_nonfinite"] for r in rows] == [0, 1, 1]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    # The skipped update left the weights exactly as they were before step 2.
    snapshots.append([p.detach().clone() for p in tiny_model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
    assert read_summary(tmp_path)["status"] == "finished"


def test_nonfinite_in_a_row_stops_with_checkpoint_intact(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    _nan_updates(monkeypatch, bad_calls=set(range(2, 100)))
    cfg = tiny_config(gsm8k_path, n_steps=5, save_every=1, max_consecutive_nonfinite=2)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000002"  # step 2 was skipped but finished; step 3 hit the limit
    summary = read_summary(tmp_path)
    assert summary["status"] == "failed" and "in a row" in summary["message"] and summary["last_checkpoint"] == 2
    from rlvr.modeling import build_model

    reloaded = build_model(tiny_model.config, seed=123)
    load_model_weights(reloaded, ckpt / "model")
    for a, b in zip(reloaded.parameters(), tiny_model.parameters()):
        assert torch.equal(a, b)  # NaN updates were never applied


class FailingEngine:
    def __init__(self, inner, fail_at_call):
        self.inner, self.fail_at_call, self.calls = inner, fail_at_call, 0

    def generate(self, prompts, params):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise ConnectionError("server went away")
        return self.inner.generate(prompts, params)

    def sync_weights(self, model):
        return self.inner.sync_weights(model)

    def close(self):
        pass


def test_engine_failure_stops_with_clear_message(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    from rlvr.engines.hf import HFEngine

    engine = FailingEngine(HFEngine(tiny_model, tiny_tokenizer), fail_at_call=3)  # call 1 is the initial eval
    cfg = tiny_config(gsm8k_path, n_steps=3, save_every=1)
    with pytest.raises(EngineError, match="failed to generate at step 2.*ConnectionError"):
        run(cfg, tmp_path, tiny_model, tiny_tokenizer, engine=engine)
    assert latest_checkpoint(tmp_path).name == "step_000001"
    assert read_summary(tmp_path)["status"] == "failed"


def test_grader_returning_nan_is_a_grader_failure(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    def nan_reward(response, gt):
        return {"reward": float("nan"), "format_reward": 0.0}

    with pytest.raises(GraderError, match="non-finite reward"):
        run(tiny_config(gsm8k_path, n_steps=1), tmp_path, tiny_model, tiny_tokenizer, reward_fn=nan_reward)


def test_ctrl_c_saves_and_resumes(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    calls = {"n": 0}

    def interrupt_in_step_2(response, gt):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return parity_reward(response, gt)

    cfg = tiny_config(gsm8k_path, n_steps=3)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path, tiny_model, tiny_tokenizer, reward_fn=interrupt_in_step_2)
    assert latest_checkpoint(tmp_path).name == "step_000001"
    summary = read_summary(tmp_path)
    assert summary["status"] == "interrupted" and summary["step"] == 1
    run(cfg, tmp_path, tiny_model, tiny_tokenizer, resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_cli_trains_from_a_config_file_and_resumes(gsm8k_path, tmp_path):
    from rlvr.cli import main

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(
        "model: {fresh: tiny, tokenizer_vocab_size: 300}\n"
        f"data: {{train_source: {gsm8k_path}, train_size: 8, val_size: 2}}\n"
        "prompt: question_only\n"
        "rollout: {n_prompts_per_rollout_batch: 2, group_size: 2, max_new_tokens: 4}\n"
        "optim: {gradient_accumulation_steps: 1}\n"
        "log: {progress: false}\n"
        "n_steps: 1\neval_every: 0\n"
    )
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg_file), "--optim.lr", "3e-6", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["optim"]["lr"] == 3e-6 and saved["model"]["fresh"] == "tiny"
    assert main(["train", "--resume", str(out), "--n_steps", "2"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert (
        main(["train", "--config", str(cfg_file), "--out", str(tmp_path / "bad"), "--optim.train_batch_size", "3"]) == 2
    )
    assert not (tmp_path / "bad" / "config.json").exists()  # rejected before anything was written


def test_plugins_field_makes_a_custom_estimator_selectable(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    from pathlib import Path

    plugin = Path(__file__).resolve().parents[2] / "examples" / "my_estimator.py"
    cfg = tiny_config(
        gsm8k_path,
        plugins=(str(plugin),),
        algorithm=AlgorithmConfig(reweighting="dual_clip", cliprange=0.2),
        optim=OptimConfig(lr=1e-3, gradient_accumulation_steps=1, train_batch_size=4),
    )
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(0 <= r["train/clip_fraction"] <= 1 for r in rows if r["step"] > 0)
    assert json.loads((tmp_path / "config.json").read_text())["plugins"] == [str(plugin)]


def test_token_budget_microbatches_train_the_same_model(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    """``optim.max_tokens_per_microbatch`` changes how the batch is cut, not the update: after two steps
    the weights equal those of the row-count microbatches (up to float summation order)."""
    import copy

    results = []
    for name, optim in [
        ("rows", OptimConfig(lr=1e-3, gradient_accumulation_steps=2)),
        ("budget", OptimConfig(lr=1e-3, gradient_accumulation_steps=1, max_tokens_per_microbatch=24)),
    ]:
        model = copy.deepcopy(tiny_model)
        run(tiny_config(gsm8k_path, optim=optim), tmp_path / name, model, tiny_tokenizer)
        rows = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["step"] > 0]
        results.append((model, rows))
    (m_rows, r_rows), (m_budget, r_budget) = results
    assert [r["train/loss"] for r in r_rows] == pytest.approx([r["train/loss"] for r in r_budget], rel=1e-4, abs=1e-6)
    for a, b in zip(m_rows.parameters(), m_budget.parameters()):  # Adam moves each weight by about lr = 1e-3 a step
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    moved = sum(float((a - b).abs().sum()) for a, b in zip(m_rows.parameters(), tiny_model.parameters()))
    assert moved > 0  # the runs did train


def test_token_budget_must_be_positive(gsm8k_path):
    from rlvr.config import ConfigError

    with pytest.raises(ConfigError, match="max_tokens_per_microbatch must be >= 1"):
        validate_config(resolve_config(tiny_config(gsm8k_path, optim=OptimConfig(max_tokens_per_microbatch=0))))


def test_model_compile_trains_on_one_graph(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    """``model.compile``: three steps with microbatches of changing shapes (a token budget, a lone row
    possible) and eager rollouts, old log-probs and validation in between, on one compiled graph."""
    pytest.importorskip("torch._inductor")
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rlvr.config import ModelConfig

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_config(
        gsm8k_path,
        n_steps=3,
        eval_every=2,
        model=ModelConfig(compile=True),
        optim=OptimConfig(lr=1e-3, gradient_accumulation_steps=1, max_tokens_per_microbatch=40),
        algorithm=AlgorithmConfig(reweighting="grpo", cliprange=0.2),
    )
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    check_sane(rows, clipping=True)
    # one decoder-layer forward shared by every layer, plus the fused log-prob's two float32 passes
    # (forward with entropy, gradient); a recompile for some microbatch shape would add to these
    assert counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()


def test_hf_fast_engine_gets_the_engine_config(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    """``engine.max_batch_size``, ``release_memory``, ``attention``, ``fuse_projections`` and ``cascade_min_rows`` reach the
    hf-fast engine (max_batch_size was once dropped for it), and a run with the cache released after
    every generation trains as usual."""
    from rlvr.config import ConfigError, EngineConfig, FastEngineConfig
    from rlvr.engines import build_engine
    from rlvr.engines.fast import FastHFEngine

    cfg = tiny_config(
        gsm8k_path,
        engine=EngineConfig(
            name="hf-fast",
            max_batch_size=4,
            fast=FastEngineConfig(release_memory=True, attention="sdpa", fuse_projections=False, cascade_min_rows=None),
        ),
    )
    engine = build_engine(cfg.engine, tiny_model, tiny_tokenizer)  # as the trainer builds it
    assert isinstance(engine, FastHFEngine)
    assert (
        engine.max_batch_size,
        engine.release_memory,
        engine.attention,
        engine.fuse_projections,
        engine.cascade_min_rows,
    ) == (4, True, "sdpa", False, None)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    check_sane(read_metrics(tmp_path / "metrics.jsonl"))

    def fast_engine(name, **options):
        return EngineConfig(name=name, fast=FastEngineConfig(**options))

    with pytest.raises(ConfigError, match="engine.fast.release_memory applies to the hf-fast engine"):
        validate_config(resolve_config(tiny_config(gsm8k_path, engine=fast_engine("hf", release_memory=True))))
    with pytest.raises(ConfigError, match="engine.fast.attention must be auto, triton or sdpa, got 'flash'"):
        validate_config(resolve_config(tiny_config(gsm8k_path, engine=fast_engine("hf-fast", attention="flash"))))
    with pytest.raises(ConfigError, match="engine.fast.attention applies to the hf-fast engine"):
        validate_config(resolve_config(tiny_config(gsm8k_path, engine=fast_engine("hf", attention="sdpa"))))
    with pytest.raises(ConfigError, match="engine.fast.fuse_projections applies to the hf-fast engine"):
        validate_config(resolve_config(tiny_config(gsm8k_path, engine=fast_engine("hf", fuse_projections=False))))
    with pytest.raises(ConfigError, match="engine.fast.cascade_min_rows applies to the hf-fast engine"):
        validate_config(resolve_config(tiny_config(gsm8k_path, engine=fast_engine("hf", cascade_min_rows=8))))
    with pytest.raises(ConfigError, match="engine.fast.cascade_min_rows must be >= 1"):
        validate_config(resolve_config(tiny_config(gsm8k_path, engine=fast_engine("hf-fast", cascade_min_rows=0))))
