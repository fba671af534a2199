"""CPU tests of the worker engine over gloo: a real second process, real bucketed syncs, the probe check
passing after a real weight change and catching a planted mismatch."""

from __future__ import annotations

import pytest
import torch

from rlvr.engines import make_engine
from rlvr.engines.base import SamplingParams
from rlvr.engines.hf import HFEngine
from rlvr.engines.worker import WeightSyncError, build_plan

PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "How many"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _ids(out):
    return [[c.token_ids for c in group] for group in out]


@pytest.fixture(scope="module")
def trainer_model(tiny_tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    config = small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    return build_model(config, seed=1)


@pytest.fixture(scope="module")
def worker(trainer_model, tiny_tokenizer):
    # A small bucket size forces several buckets, including dtype boundaries (float params, buffers).
    engine = make_engine("hf-worker", trainer_model, tiny_tokenizer, device="cpu", bucket_mb=0.05, max_batch_size=8)
    yield engine
    engine.close()


def test_plan_buckets_by_dtype_and_size(trainer_model):
    plan = build_plan(trainer_model, bucket_mb=0.05)
    assert len(plan) > 1
    names = [name for b in plan for name, _, _ in b["tensors"]]
    expected = [n for n, _ in trainer_model.named_parameters()] + [n for n, _ in trainer_model.named_buffers()]
    assert names == expected
    for b in plan:
        assert (
            len(
                {
                    dict(trainer_model.named_parameters()).get(n, dict(trainer_model.named_buffers()).get(n)).dtype
                    for n, _, _ in b["tensors"]
                }
            )
            == 1
        )
        # a bucket exceeds the limit only when it holds a single tensor larger than the limit
        assert b["bytes"] <= 0.05 * 2**20 or len(b["tensors"]) == 1


def test_worker_matches_in_process_engine_after_start(worker, trainer_model, tiny_tokenizer):
    local = HFEngine(trainer_model, tiny_tokenizer, max_batch_size=8)
    assert _ids(worker.generate(PROMPTS, GREEDY)) == _ids(local.generate(PROMPTS, GREEDY))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=7)
    remote, here = worker.generate(PROMPTS, params), local.generate(PROMPTS, params)
    assert _ids(remote) == _ids(here)
    torch.testing.assert_close(torch.tensor(remote[0][1].logprobs), torch.tensor(here[0][1].logprobs))


def test_sync_after_weight_change_updates_engine(worker, trainer_model, tiny_tokenizer):
    before = _ids(worker.generate(PROMPTS, GREEDY))
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in trainer_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    stale = worker.probe_diff(trainer_model)
    assert stale > worker.probe_tolerance  # the change is visible to the probe before the sync
    info = worker.sync_weights(trainer_model)
    assert set(info) == {"time/sync", "sync/probe_max_abs_diff"}
    assert info["sync/probe_max_abs_diff"] <= 1e-5
    after = _ids(worker.generate(PROMPTS, GREEDY))
    expected = _ids(HFEngine(trainer_model, tiny_tokenizer).generate(PROMPTS, GREEDY))
    assert after == expected
    assert after != before


def test_planted_mismatch_is_caught_then_a_clean_sync_recovers(worker, trainer_model):
    name = worker.plant_mismatch()
    assert name.startswith("lm_head")
    with pytest.raises(WeightSyncError, match="do not match"):
        worker.sync_weights(trainer_model)
    info = worker.sync_weights(trainer_model)  # the plant is one-shot
    assert info["sync/probe_max_abs_diff"] <= 1e-5


def test_planted_mismatch_in_a_hidden_layer_is_caught(worker, trainer_model):
    worker.plant_mismatch("model.layers.0.mlp.down_proj.weight")
    with pytest.raises(WeightSyncError):
        worker.sync_weights(trainer_model)
    worker.sync_weights(trainer_model)


def test_worker_reports_its_errors(worker):
    with pytest.raises(RuntimeError, match="no tensor"):
        worker.plant_mismatch("not.a.tensor")
