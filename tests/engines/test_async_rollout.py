"""CPU tests (gloo) of one-step-asynchronous rollouts on a real worker process.

The "trainer" here changes its weights deterministically at every step: version v is the base model
plus noise seeded by v. So which weights sampled a batch can be read off the batch itself: its
completions equal those of an in-process engine holding exactly one version (same seed, same chunk
layout) and no other, and its old log-probs equal a teacher-forced recomputation under that version.
"""

from __future__ import annotations

import time

import pytest
import torch

from rlvr.engines import make_engine
from rlvr.engines.async_rollout import AsyncRollouts, RolloutOrderError
from rlvr.engines.base import SamplingParams
from rlvr.engines.hf import HFEngine
from rlvr.engines.worker import WeightSyncError
from rlvr.training.logprobs import compute_log_probs_batched

MAX_BATCH = 8
PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "How many", "Weng earns $12 an hour."]


def request(step: int):
    return PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=100 + step)


def _ids(groups):
    return [[c.token_ids for c in g] for g in groups]


@pytest.fixture(scope="module")
def trainer_model(tiny_tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    config = small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    return build_model(config, seed=5)


@pytest.fixture(scope="module")
def base_state(trainer_model):
    return {k: v.clone() for k, v in trainer_model.state_dict().items()}


def set_version(model, base_state, v: int):
    """Load weight version ``v``: the base weights plus noise seeded by ``v`` (version 0 is the base)."""
    model.load_state_dict(base_state)
    if v:
        g = torch.Generator().manual_seed(1000 + v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def versions(trainer_model, base_state, tiny_tokenizer):
    """In-process copies of versions 0..4 (all that the tests use), to read off which one sampled a batch."""
    import copy

    out = {}
    for v in range(5):
        m = copy.deepcopy(trainer_model)
        set_version(m, base_state, v)
        m.eval()
        out[v] = m
    return out


@pytest.fixture(scope="module")
def engine(trainer_model, base_state, tiny_tokenizer):
    set_version(trainer_model, base_state, 0)
    # several buckets per sync, like a real model
    eng = make_engine(
        "hf-worker", trainer_model, tiny_tokenizer, device="cpu", bucket_mb=0.05, max_batch_size=MAX_BATCH
    )
    yield eng
    eng.close()


def sampled_by(batch, versions, tokenizer) -> list[int]:
    """Every version whose in-process engine reproduces the batch's completions exactly."""
    return [
        v
        for v, m in versions.items()
        if _ids(HFEngine(m, tokenizer, max_batch_size=MAX_BATCH).generate(batch.prompts, batch.params))
        == _ids(batch.completions)
    ]


def masked_max_diff(a, b, mask):
    return float((a - b).abs()[mask].max())


def test_one_step_async_schedule_tags_versions_and_old_log_probs(
    engine, trainer_model, base_state, versions, tiny_tokenizer
):
    set_version(trainer_model, base_state, 0)
    with AsyncRollouts(engine, max_staleness=1) as rollouts:
        for step in range(1, 5):
            # the trainer holds version step-1 here
            batch = rollouts.next_batch(step, trainer_model, request)
            expected = max(step - 2, 0)
            assert batch.step == step and batch.weight_version == expected
            assert sampled_by(batch, versions, tiny_tokenizer) == [expected]
            mask = batch.response_mask
            assert mask.shape == batch.old_log_probs.shape == batch.labels.shape
            assert int(mask.sum()) > 0
            sampler = compute_log_probs_batched(versions[expected], batch.input_ids, batch.labels, 16)
            assert masked_max_diff(batch.old_log_probs, sampler, mask) <= 1e-5
            if step >= 2:  # one step stale: the current weights give other log-probs
                current = compute_log_probs_batched(versions[step - 1], batch.input_ids, batch.labels, 16)
                assert masked_max_diff(batch.old_log_probs, current, mask) > 1e-2
            assert batch.metrics(step - 1)["rollout/staleness"] == (step - 1) - expected
            assert batch.sync["sync/probe_max_abs_diff"] <= 1e-5
            # the retokenised batch is the trainer's own tokenisation of the same text
            from rlvr.training.tokenize import tokenize_prompt_and_output

            mine = tokenize_prompt_and_output(
                [p for p in batch.prompts for _ in range(2)], batch.responses, tiny_tokenizer
            )
            assert torch.equal(mine["input_ids"], batch.input_ids) and torch.equal(mine["response_mask"], mask)
            set_version(trainer_model, base_state, step)  # "train" on the batch: version step
        syncs = [e[1] for e in rollouts.events if e[0] == "sync_start"]
        assert [e[1] for e in rollouts.events if e[0] == "sync_requested"] == [0, 1, 2, 3]
        assert syncs == [0, 1, 2, 3]  # versions 0..3 loaded once each, in order
        # every rollout ran between the load of its version and the next load
        loaded = None
        for e in rollouts.events:
            if e[0] == "sync_end":
                loaded = e[1]
            elif e[0] == "rollout_start":
                assert e[2] == loaded


def test_synchronous_mode_is_on_policy(engine, trainer_model, base_state, versions, tiny_tokenizer):
    set_version(trainer_model, base_state, 0)
    with AsyncRollouts(engine, max_staleness=0) as rollouts:
        for step in range(1, 4):
            batch = rollouts.next_batch(step, trainer_model, request)
            assert batch.weight_version == step - 1
            assert sampled_by(batch, versions, tiny_tokenizer) == [step - 1]
            current = compute_log_probs_batched(versions[step - 1], batch.input_ids, batch.labels, 16)
            assert masked_max_diff(batch.old_log_probs, current, batch.response_mask) <= 1e-5
            set_version(trainer_model, base_state, step)
    with AsyncRollouts(engine, max_staleness=0, old_log_probs=False) as rollouts:  # on-policy, no reweighting
        batch = rollouts.next_batch(4, trainer_model, request)
        assert batch.weight_version == 3 and batch.old_log_probs is None
        assert sampled_by(batch, versions, tiny_tokenizer) == [3]
        # validation after "training" step 4 sees version 4, through the same queue
        set_version(trainer_model, base_state, 4)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        evaluated = rollouts.engine_for_eval(trainer_model, 4).generate(PROMPTS, greedy)
        assert _ids(evaluated) == _ids(
            HFEngine(versions[4], tiny_tokenizer, max_batch_size=MAX_BATCH).generate(PROMPTS, greedy)
        )
        assert rollouts.events[-2:] == [("sync_start", 4), ("sync_end", 4)]


def test_sync_requested_during_generation_is_queued_after_it(
    engine, trainer_model, base_state, versions, tiny_tokenizer
):
    set_version(trainer_model, base_state, 0)
    long = SamplingParams(n=4, temperature=1.0, max_new_tokens=48, seed=3)
    with AsyncRollouts(engine, max_staleness=1) as rollouts:
        rollouts.sync(trainer_model, 0).result()
        rollouts.submit(1, PROMPTS, long)
        while ("rollout_start", 1, 0) not in rollouts.events:  # the request is on its way to the worker
            time.sleep(0.001)
        set_version(trainer_model, base_state, 1)
        load = rollouts.sync(trainer_model, 1)  # asked for while step 1 is generating
        set_version(trainer_model, base_state, 2)  # the trainer moves on: the snapshot must not see this
        rollouts.submit(2, *request(2))
        first, second = rollouts.collect(1), rollouts.collect(2)
        assert load.result()["sync/probe_max_abs_diff"] <= 1e-5
        assert first.weight_version == 0 and second.weight_version == 1
        assert sampled_by(second, versions, tiny_tokenizer) == [1]
        for batch in (first, second):
            ref = compute_log_probs_batched(versions[batch.weight_version], batch.input_ids, batch.labels, 16)
            assert masked_max_diff(batch.old_log_probs, ref, batch.response_mask) <= 1e-5
        kinds = [(e[0], e[1]) for e in rollouts.events]
        assert (
            kinds.index(("rollout_start", 1))
            < kinds.index(("sync_requested", 1))
            < kinds.index(("sync_start", 1))
            < kinds.index(("rollout_start", 2))
        )
        assert kinds.index(("rollout_end", 1)) < kinds.index(("sync_start", 1))
        with pytest.raises(ValueError, match="older"):
            rollouts.sync(trainer_model, 0)
        with pytest.raises(KeyError):
            rollouts.collect(1)  # handed over once


def test_probe_check_catches_a_planted_mismatch_then_recovers(engine, trainer_model, base_state):
    set_version(trainer_model, base_state, 0)
    with AsyncRollouts(engine, max_staleness=1) as rollouts:
        rollouts.sync(trainer_model, 0).result()
        engine.plant_mismatch()  # corrupts the output head on the next receive
        set_version(trainer_model, base_state, 1)
        load = rollouts.sync(trainer_model, 1)
        rollouts.submit(1, *request(1))
        with pytest.raises(WeightSyncError, match="do not match"):
            load.result()
        with pytest.raises(WeightSyncError):  # never sampled from the unverified weights
            rollouts.collect(1)
        assert engine.weight_version is None
        meta = rollouts.sync(trainer_model, 1).result()  # a clean retry of the same version
        assert meta["sync/probe_max_abs_diff"] <= 1e-5
        rollouts.submit(1, *request(1))
        assert rollouts.collect(1).weight_version == 1


def test_a_load_behind_its_back_is_detected(engine, trainer_model, base_state):
    set_version(trainer_model, base_state, 0)
    with AsyncRollouts(engine, max_staleness=1) as rollouts:
        rollouts.sync(trainer_model, 0).result()
        engine.sync_weights(trainer_model)  # untagged: AsyncRollouts cannot know what was loaded
        rollouts.submit(1, *request(1))
        with pytest.raises(RolloutOrderError, match="version"):
            rollouts.collect(1)


def test_in_process_engine_is_refused(trainer_model, tiny_tokenizer):
    with pytest.raises(TypeError, match="hf-worker"):
        AsyncRollouts(HFEngine(trainer_model, tiny_tokenizer))


def test_async_without_old_log_probs_is_refused(engine):
    with pytest.raises(ValueError, match="old log-probs"):
        AsyncRollouts(engine, max_staleness=1, old_log_probs=False)


def test_close_with_work_queued_is_clean(trainer_model, base_state, tiny_tokenizer):
    set_version(trainer_model, base_state, 0)
    eng = make_engine("hf-worker", trainer_model, tiny_tokenizer, device="cpu", max_batch_size=MAX_BATCH)
    proc = eng._proc
    rollouts = AsyncRollouts(eng, max_staleness=1, close_engine=True)
    rollouts.sync(trainer_model, 0)
    first = rollouts.submit(1, *request(1))
    queued = [rollouts.submit(s, *request(s)) for s in range(2, 5)]
    rollouts.close()
    assert first.done() and all(f.done() for f in queued)
    assert not any(t.name.startswith("rlvr-rollouts") for t in __import__("threading").enumerate())
    assert not proc.is_alive() and proc.exitcode == 0
    with pytest.raises(RuntimeError, match="closed"):
        rollouts.submit(5, *request(5))
