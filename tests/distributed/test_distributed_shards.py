"""Each rank's share of a rollout batch, metrics reduced across ranks, and rank-0-only output."""

from __future__ import annotations

import json

import pytest
from distributed_helpers import run_ranks

from rlvr.checks import check_world, resolve_config, validate_config


def rank_batch_indices(n_examples: int, n_prompts: int, step: int, seed: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s examples at a step, as the trainer takes them: its prompt range of the one-process batch."""
    from rlvr.distributed import rank_prompt_range
    from rlvr.task.data_order import batch_indices

    share = rank_prompt_range(n_prompts, rank, world_size)
    return batch_indices(n_examples, n_prompts, step, seed)[share.start : share.stop]


def test_rank_shares_are_the_one_process_batch_in_order():
    from rlvr.task.data_order import batch_indices

    n_examples, n_prompts, seed = 23, 6, 7
    for world_size in (1, 2, 3, 6):
        for step in range(12):  # crosses several epochs, one of them inside a batch
            shares = [rank_batch_indices(n_examples, n_prompts, step, seed, r, world_size) for r in range(world_size)]
            assert all(len(s) == n_prompts // world_size for s in shares)
            assert [i for s in shares for i in s] == batch_indices(n_examples, n_prompts, step, seed)


def test_every_prompt_once_per_epoch_across_ranks():
    n_examples, n_prompts, world_size = 24, 8, 4  # three steps per epoch
    for epoch in range(3):
        seen = [
            i
            for step in range(3 * epoch, 3 * epoch + 3)
            for r in range(world_size)
            for i in rank_batch_indices(n_examples, n_prompts, step, 0, r, world_size)
        ]
        assert sorted(seen) == list(range(n_examples))


def test_groups_never_span_ranks():
    from rlvr.distributed import local_rows, rank_prompt_range, rank_row_range

    P, G, W = 6, 4, 3
    rows = [rank_row_range(P, G, r, W) for r in range(W)]
    assert [i for r in rows for i in r] == list(range(P * G))
    for r in range(W):
        prompts = rank_prompt_range(P, r, W)
        assert {row // G for row in rows[r]} == set(prompts)  # whole groups, nothing else
    minibatch = [17, 3, 9, 22, 4]  # global rows of a shuffled minibatch
    assert local_rows(minibatch, rows[0]) == [3, 4]
    assert local_rows(minibatch, rows[1]) == [9 - 8]
    assert local_rows(minibatch, rows[2]) == [17 - 16, 22 - 16]


def test_prompts_not_divisible_by_ranks_is_a_clear_error():
    from rlvr.config import ConfigError
    from rlvr.distributed import check_prompts_divisible

    with pytest.raises(ConfigError, match=r"n_prompts_per_rollout_batch=6 does not split over 4 ranks.*multiple of 4"):
        check_prompts_divisible(6, 4)
    with pytest.raises(ConfigError):
        rank_batch_indices(10, 6, 0, 0, 0, 4)


def test_one_process_world_without_torchrun(monkeypatch):
    from rlvr.distributed import init_distributed, mean_metrics, on_main, reduce_values

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    world = init_distributed("cpu")
    assert (world.rank, world.world_size, world.is_main, world.distributed) == (0, 1, True, False)
    assert mean_metrics({"a": 2.0}) == {"a": 2.0}
    assert reduce_values([1, 2], "max") == [1.0, 2.0]
    assert on_main(lambda: 5) == 5


def _metrics_worker(world, out_dir):
    from rlvr.distributed import gather_objects, max_metrics, mean_metrics, on_main, reduce_values, sum_metrics

    r = world.rank
    local = {"loss": 1.0 + r, "tokens": 10.0 * (r + 1)}
    result = {
        "world": [world.rank, world.world_size, world.backend],
        "sum": sum_metrics(local),
        "mean": mean_metrics(local),
        "max": max_metrics(local),
        "min": reduce_values([5 - r], "min"),
        "gathered": gather_objects({"rank": r}),
        "written_by": on_main(lambda: r),
    }

    def write():
        (out_dir / "metrics.jsonl").open("a").write(json.dumps({"rank": r}) + "\n")

    on_main(write)
    with open(out_dir / f"rank{r}.json", "w") as f:
        json.dump(result, f)
    try:
        on_main(lambda: 1 / 0)
    except ZeroDivisionError:
        errors = "raised on rank 0"
    except RuntimeError as e:
        errors = str(e)
    with open(out_dir / f"errors{r}.txt", "w") as f:
        f.write(errors)


def test_metrics_reduced_and_written_once(tmp_path):
    run_ranks(_metrics_worker, tmp_path)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["world"] == [r, 2, "gloo"]
        assert res["sum"] == {"loss": 3.0, "tokens": 30.0}
        assert res["mean"] == {"loss": 1.5, "tokens": 15.0}
        assert res["max"] == {"loss": 2.0, "tokens": 20.0}
        assert res["min"] == [4.0]
        assert res["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert res["written_by"] == (0 if r == 0 else None)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"rank": 0}']
    # a failure on rank 0 reaches the other ranks instead of leaving them in the next collective
    assert (tmp_path / "errors0.txt").read_text() == "raised on rank 0"
    assert "failed on rank 0" in (tmp_path / "errors1.txt").read_text()


def test_data_parallel_settings_that_cannot_work_are_clear_errors():
    from rlvr.config import ConfigError, TrainConfig

    def config(**sections):
        return resolve_config(TrainConfig.from_dict({"rollout": {"n_prompts_per_rollout_batch": 4}, **sections}))

    with pytest.raises(ConfigError, match="distributed.cpu_offload needs distributed.strategy fsdp"):
        validate_config(config(distributed={"cpu_offload": True}))
    assert config().data_parallel_strategy(1) == "none" and config().data_parallel_strategy(2) == "ddp"
    check_world(config(), 1)
    check_world(config(), 2)
    with pytest.raises(ConfigError, match="strategy is none; set it to ddp or fsdp"):
        check_world(config(distributed={"strategy": "none"}), 2)
    with pytest.raises(ConfigError, match="does not split over 3 ranks"):
        check_world(config(), 3)
    with pytest.raises(ConfigError, match="engine.name=hf-worker"):
        check_world(config(engine={"name": "hf-worker"}), 2)
    with pytest.raises(ConfigError, match="set model.compile false"):
        check_world(config(model={"compile": True}, distributed={"strategy": "fsdp"}), 1)
    with pytest.raises(ConfigError, match="set optim.shared_prefix false"):
        validate_config(config(optim={"shared_prefix": True}, distributed={"strategy": "ddp"}))
    check_world(config(optim={"shared_prefix": True}), 1)
    with pytest.raises(ConfigError, match="shared_prefix packs microbatches in one process; set it false"):
        check_world(config(optim={"shared_prefix": True}), 2)
    check_world(config(algorithm={"kl_coef": 0.1, "kl_reference_device": "cpu"}), 1)
    with pytest.raises(ConfigError, match="kl_reference_device places the reference in one process"):
        check_world(config(algorithm={"kl_coef": 0.1, "kl_reference_device": "cpu"}), 2)


def test_global_metrics_combines_equal_rank_shares_by_hand():
    from rlvr.commands.train import global_metrics

    rank0 = {
        "step": 3,
        "train/reward": 0.25,
        "time/generate": 2.0,
        "tokens_per_s": 100.0,
        "train/loss": 0.5,
        "train/reward_std": 0.1,
        "updates": ["rank 0"],
        "train/reward/timeouts": 1.0,
        "mem/peak_gb": 10.0,
    }
    rank1 = {
        "step": 3,
        "train/reward": 0.75,
        "time/generate": 3.0,
        "tokens_per_s": 50.0,
        "train/loss": 0.5,
        "train/reward_std": 0.2,
        "updates": ["rank 1"],
        "train/reward/timeouts": 2.0,
        "mem/peak_gb": 12.0,
    }
    # rewards 0,0,0,1 and 1,1,0,1: mean 0.25 and 0.75; all eight have mean 0.5 and unbiased std sqrt(2/7)
    out = global_metrics([rank0, rank1], [[0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    assert out["train/reward"] == 0.5  # (0.25 + 0.75) / 2: equal shares
    assert out["time/generate"] == 3.0 and out["mem/peak_gb"] == 12.0  # the slowest, the largest rank
    assert out["tokens_per_s"] == 150.0 and out["train/reward/timeouts"] == 3.0  # sums
    assert out["train/loss"] == 0.5 and out["step"] == 3  # already global: passes through
    assert out["updates"] == ["rank 0"]
    assert out["train/reward_std"] == pytest.approx((2 / 7) ** 0.5)


def test_global_metrics_sums_counts_the_ranks_share_equally():
    from rlvr.commands.train import global_metrics

    # each rank resampled three groups and generated at the same rate: the step resampled six, at twice the rate
    rank = {"step": 1, "rollout/filter_resampled": 3, "rollout/filter_rounds": 2, "tokens_per_s": 40.0}
    out = global_metrics([dict(rank), dict(rank)], [[1.0], [0.0]])
    assert out["rollout/filter_resampled"] == 6 and out["tokens_per_s"] == 80.0
    assert out["rollout/filter_rounds"] == 2 and out["step"] == 1
