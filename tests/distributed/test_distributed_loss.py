"""Two gloo ranks give the one-process gradient of the same batch: DDP and FSDP2, both loss
normalisations, on- and off-policy reweighting methods, several microbatches, token budgets, the
zero-advantage skip, and a rank whose share of a minibatch is all-zero or empty; both wrappers keep
the fused log-prob head. FSDP2 with bfloat16
compute keeps float32 master weights and optimizer state; CPU offload and gradient checkpointing
(FSDP2 and DDP) change no number."""

from __future__ import annotations

import json

import pytest
import torch
from distributed_helpers import run_ranks, tiny_causal_lm

P, G = 4, 2  # prompts × samples; each rank holds half of the prompts

CASES = {
    # name: (loss_normalization, method, gradient_accumulation_steps, max_tokens_per_microbatch, advantages, rows
    #        [, max_grad_norm])
    "sequence-none": ("sequence", "none", 1, None, "mixed", "all"),
    "sequence-grpo-microbatches": ("sequence", "grpo", 4, None, "mixed", "all"),
    "constant-grpo-token-budget": ("constant", "grpo", 1, 30, "mixed", "all"),
    "sequence-gspo": ("sequence", "gspo", 1, None, "mixed", "all"),
    "constant-none-microbatches": ("constant", "none", 4, None, "mixed", "all"),
    "sequence-cispo": ("sequence", "cispo", 1, None, "mixed", "all"),
    # the second rank has only zero advantages: it skips every row and pads to join the first rank's microbatches
    "sequence-grpo-rank1-all-zero": ("sequence", "grpo", 2, None, "rank1-zero", "all"),
    # a shuffled minibatch can leave a rank with no rows at all
    "constant-noclip-rank1-empty": ("constant", "noclip", 1, None, "mixed", "rank0-only"),
    # the gradient norm is clipped, with the global norm
    "sequence-grpo-clipped": ("sequence", "grpo", 2, None, "mixed", "all", 0.5),
}
ADVANTAGES = {
    "mixed": [1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 2.0, -1.5],
    "rank1-zero": [1.0, -1.0, 0.7, -0.7, 0.0, 0.0, 0.0, 0.0],
}


def _batch():
    from rlvr.training.tokenize import tokenize_from_ids

    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(2, 64, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(P)
    ]
    outputs = [
        torch.randint(2, 64, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(P * G)
    ]
    batch = tokenize_from_ids([prompts[i // G] for i in range(P * G)], outputs, 0)
    with torch.no_grad():
        from rlvr.training.logprobs import get_response_log_probs

        logp = get_response_log_probs(tiny_causal_lm(seed=0).eval(), batch["input_ids"], batch["labels"])["log_probs"]
    # Sampling weights a little away from the current ones, so ratios are not one and some clip.
    batch["old_log_probs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    return batch


def _update(model, batch, rows, case, global_batch=None):
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    normalization, method, gas, max_tokens, adv_name, _ = case[:6]
    max_grad_norm = case[6] if len(case) > 6 else None
    idx = torch.tensor(rows, dtype=torch.long)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # a unit step: new weights = old − gradient
    spec = UpdateSpec(
        gas,
        max_grad_norm,
        reweighting=method,
        cliprange=None if method in ("none", "noclip") else 0.2,
        loss_normalization=normalization,
        normalization_constant=float(P * G * 10),
        max_tokens_per_microbatch=max_tokens,
    )
    rows_batch = StepBatch(
        batch["input_ids"][idx],
        batch["labels"][idx],
        batch["response_mask"][idx],
        torch.tensor(ADVANTAGES[adv_name])[idx],
        batch["old_log_probs"][idx],
    )
    loss, meta = policy_gradient_update(model, optimizer, rows_batch, spec, global_batch=global_batch)
    return float(loss), meta


def _refuse_full_logits(*args, **kwargs):
    raise AssertionError("a wrapped model took the full-logits path instead of the fused head")


def _compare_worker(world, strategy, out_path):
    import rlvr.training.logprobs
    from rlvr.distributed import GlobalBatch, gather_objects, rank_row_range
    from rlvr.distributed.wrap import iter_full_weights, wrap_model

    rlvr.training.logprobs._stats_from_logits = _refuse_full_logits  # DDP and FSDP2 keep the fused head

    batch = _batch()
    report = {}
    for name, case in CASES.items():
        all_rows = list(range(P * G)) if case[5] == "all" else list(range(P * G // 2))
        reference = tiny_causal_lm(seed=0)
        ref_loss, ref_meta = _update(reference, batch, all_rows, case)
        held = rank_row_range(P, G, world.rank, world.world_size)
        mine = [r for r in all_rows if r in held]
        model = wrap_model(tiny_causal_lm(seed=0), strategy)
        loss, meta = _update(model, batch, mine, case, GlobalBatch.of(len(mine)))
        ref_weights = reference.state_dict()
        weight_diff = max(float((t - ref_weights[n]).abs().max()) for n, t in iter_full_weights(model))
        moved = max(
            float((t - tiny_causal_lm(seed=0).state_dict()[n]).abs().max()) for n, t in reference.state_dict().items()
        )
        keys = ("grad_norm", "entropy", "n_sequences", "n_tokens", "clip_fraction")
        report[name] = {
            "weight_diff": weight_diff,
            "moved": moved,
            "loss": [loss, ref_loss],
            "microbatches_per_rank": gather_objects(meta["n_microbatches"]),
            "meta": {k: [meta.get(k), ref_meta.get(k)] for k in keys},
            "importance": [meta.get("importance", {}), ref_meta.get("importance", {})],
        }
    if world.is_main:
        with open(out_path, "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_give_the_one_process_gradient(strategy, tmp_path):
    out = tmp_path / "report.json"
    run_ranks(_compare_worker, strategy, str(out))
    report = json.loads(out.read_text())
    assert set(report) == set(CASES)
    for name in ("sequence-grpo-microbatches", "constant-none-microbatches", "constant-grpo-token-budget"):
        counts = report[name]["microbatches_per_rank"]
        assert max(counts) >= 2 and min(counts) < max(counts), f"{name}: {counts}"  # several, and padding
    for name, r in report.items():
        assert r["moved"] > 1e-3, f"{name}: the update did not move the weights, the comparison is empty"
        assert r["weight_diff"] < 1e-5 * max(1.0, r["moved"]), f"{name}: weights differ by {r['weight_diff']}"
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5, abs=1e-7), name
        for key, (got, want) in r["meta"].items():
            if want is None:
                assert got is None, f"{name}: {key}"
            else:
                assert got == pytest.approx(want, rel=1e-4, abs=1e-6), f"{name}: {key} {got} != {want}"
        got, want = r["importance"]
        assert set(got) == set(want) and want, name
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), f"{name}: importance {key}"


def _precision_worker(world, out_path):
    from rlvr.distributed import GlobalBatch
    from rlvr.distributed.wrap import copy_full_weights, full_state_dict_on_main, wrap_model
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    g = torch.Generator().manual_seed(world.rank)
    ids = torch.randint(2, 64, (4, 12), generator=g)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 5:] = True
    report = {}
    variants = {
        "float32": {},
        "bf16": {"param_dtype": torch.bfloat16},
        "bf16-offload": {"param_dtype": torch.bfloat16, "cpu_offload": True},
        "float32-checkpointing": {"activation_checkpointing": True},
        "bf16-offload-checkpointing": {
            "param_dtype": torch.bfloat16,
            "cpu_offload": True,
            "activation_checkpointing": True,
        },
        "ddp-checkpointing": {"checkpointing": True},
        "bf16-storage": {"param_dtype": torch.bfloat16, "storage": torch.bfloat16},
    }
    for name, kwargs in variants.items():
        kwargs = dict(kwargs)
        model = tiny_causal_lm(seed=0).to(kwargs.pop("storage", torch.float32))
        if kwargs.pop("checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = wrap_model(model, "ddp" if name.startswith("ddp") else "fsdp", **kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss, meta = policy_gradient_update(
            model,
            optimizer,
            StepBatch(ids, ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5])),
            UpdateSpec(2, 1.0),
            global_batch=GlobalBatch.of(4),
        )
        engine_copy = tiny_causal_lm(seed=9).to(torch.bfloat16)  # an engine's own weights, in its own dtype
        n_copied = copy_full_weights(model, engine_copy)
        full = full_state_dict_on_main(model)
        report[name] = {
            "loss": float(loss),
            "grad_norm": meta["grad_norm"],
            "n_copied": n_copied,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_dtypes": sorted({str(s["exp_avg"].dtype) for s in optimizer.state.values()}),
            "copy_matches": None
            if full is None
            else all(torch.equal(t, full[n].to(torch.bfloat16)) for n, t in engine_copy.state_dict().items()),
        }
    if world.is_main:
        with open(out_path, "w") as f:
            json.dump(report, f)


def test_fsdp_bf16_compute_float32_master_weights_and_offload(tmp_path):
    out = tmp_path / "report.json"
    run_ranks(_precision_worker, str(out))
    report = json.loads(out.read_text())
    exact = report["float32"]
    bf16_storage = report.pop("bf16-storage")  # optim.master_weights off: sharded weights and AdamW state in bf16
    assert bf16_storage["param_dtypes"] == ["torch.bfloat16"] and bf16_storage["state_dtypes"] == ["torch.bfloat16"]
    assert bf16_storage["copy_matches"] and bf16_storage["grad_norm"] == pytest.approx(
        report["bf16"]["grad_norm"], rel=5e-2
    )
    for name, r in report.items():
        assert r["param_dtypes"] == ["torch.float32"] and r["state_dtypes"] == ["torch.float32"], name
        assert r["copy_matches"] and r["n_copied"] == len(tiny_causal_lm().state_dict()), name
        assert r["loss"] == pytest.approx(exact["loss"], rel=5e-2, abs=2e-3), name
        assert r["grad_norm"] == pytest.approx(exact["grad_norm"], rel=5e-2), name
    assert report["bf16"]["loss"] != exact["loss"]  # bf16 compute did happen
    assert report["bf16-offload"]["loss"] == report["bf16"]["loss"]  # offloading moves memory, not arithmetic
    for name in ("float32-checkpointing", "ddp-checkpointing"):  # recomputation changes no number either
        assert report[name]["loss"] == pytest.approx(exact["loss"], rel=1e-6), name
        assert report[name]["grad_norm"] == pytest.approx(exact["grad_norm"], rel=1e-5), name
    offloaded, checkpointed = report["bf16-offload"], report["bf16-offload-checkpointing"]
    assert checkpointed["loss"] == offloaded["loss"]
    assert checkpointed["grad_norm"] == pytest.approx(offloaded["grad_norm"], rel=1e-5)
