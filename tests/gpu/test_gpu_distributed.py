"""FSDP2 on a GPU over NCCL (one rank on one GPU; several GPUs are another machine's job): bfloat16
compute with float32 sharded parameters and float32 gradient reduction, CPU offload, full weights
gathered tensor by tensor, DDP, and a sharded checkpoint read back on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distributed_helpers import run_ranks, tiny_causal_lm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (8, 24), generator=g)
    mask = torch.zeros(8, 24, dtype=torch.bool)
    mask[:, 8:] = True
    return ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 2.0, -2.0])


def _step(model, optimizer, world):
    from rlvr.distributed import GlobalBatch
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    ids, mask, adv = _batch()
    batch = StepBatch(ids, ids, mask, adv)
    return policy_gradient_update(model, optimizer, batch, UpdateSpec(2, 1.0), global_batch=GlobalBatch.of(len(ids)))


def _worker(world, out):
    from rlvr.distributed.checkpoint import save_sharded
    from rlvr.distributed.wrap import iter_full_weights, wrap_model

    assert "nccl" in world.backend and world.device.type == "cuda"
    start = tiny_causal_lm(seed=0).state_dict()
    results = {}
    for name, kwargs in {
        "fsdp-float32": {},
        "fsdp-bf16": {"param_dtype": torch.bfloat16},
        "fsdp-bf16-offload": {"param_dtype": torch.bfloat16, "cpu_offload": True},
        # the combination that raised CheckpointError at OLMo-2-7B's shape before checkpoint_wrapper
        "fsdp-bf16-offload-checkpointing": {
            "param_dtype": torch.bfloat16,
            "cpu_offload": True,
            "activation_checkpointing": True,
        },
        # optim.master_weights off: bf16 sharded weights and AdamW state
        "fsdp-bf16-storage": {"param_dtype": torch.bfloat16, "storage": torch.bfloat16},
    }.items():
        kwargs = dict(kwargs)
        storage = kwargs.pop("storage", torch.float32)
        model = tiny_causal_lm(seed=0).to(storage)
        if not kwargs.get("cpu_offload"):
            model = model.to(world.device)
        model = wrap_model(model, "fsdp", world.device, **kwargs)
        sharded = [p for p in model.parameters()]
        assert all(p.dtype == storage for p in sharded)  # float32 master weights unless asked otherwise
        assert all(p.device.type == ("cpu" if kwargs.get("cpu_offload") else "cuda") for p in sharded)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss, meta = _step(model, optimizer, world)
        assert all(s["exp_avg"].dtype == storage for s in optimizer.state.values())
        weights = {n: t.detach().float().cpu() for n, t in iter_full_weights(model)}
        results[name] = {"loss": float(loss), "grad_norm": meta["grad_norm"], "weights": weights}
        if name == "fsdp-bf16":
            save_sharded(out / "dcp", model, optimizer)
    ddp = wrap_model(tiny_causal_lm(seed=0).to(world.device), "ddp", world.device)
    loss, meta = _step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), world)
    results["ddp-float32"] = {
        "loss": float(loss),
        "grad_norm": meta["grad_norm"],
        "weights": {n: t.detach().cpu() for n, t in iter_full_weights(ddp)},
    }
    torch.save({"results": results, "start": start}, out / "results.pt")


def test_fsdp2_mixed_precision_offload_and_ddp_on_a_gpu(tmp_path):
    from rlvr.distributed.checkpoint import load_sharded

    run_ranks(_worker, tmp_path, world_size=1, device="cuda")
    saved = torch.load(tmp_path / "results.pt")
    res, start = saved["results"], saved["start"]
    exact, ddp = res["fsdp-float32"], res["ddp-float32"]
    assert exact["grad_norm"] > 0
    assert ddp["loss"] == pytest.approx(exact["loss"], rel=1e-4)
    for name in exact["weights"]:
        torch.testing.assert_close(ddp["weights"][name], exact["weights"][name], rtol=1e-4, atol=1e-6)
    for variant in ("fsdp-bf16", "fsdp-bf16-offload", "fsdp-bf16-offload-checkpointing", "fsdp-bf16-storage"):
        # Loss and gradient norm, not weights: AdamW's first step is about lr · sign(gradient), and
        # bf16 rounding flips the sign of the smallest gradients.
        r = res[variant]
        assert r["loss"] == pytest.approx(exact["loss"], rel=5e-2, abs=5e-3), variant
        assert r["grad_norm"] == pytest.approx(exact["grad_norm"], rel=5e-2), variant
        assert any(not torch.equal(r["weights"][n], start[n]) for n in start), variant
    # offloading moves memory, not arithmetic; recomputing activations changes no number either
    assert res["fsdp-bf16-offload"]["loss"] == pytest.approx(res["fsdp-bf16"]["loss"], rel=1e-5)
    checkpointed = res["fsdp-bf16-offload-checkpointing"]
    assert checkpointed["loss"] == pytest.approx(res["fsdp-bf16-offload"]["loss"], rel=1e-5)
    assert checkpointed["grad_norm"] == pytest.approx(res["fsdp-bf16-offload"]["grad_norm"], rel=1e-4)

    model = tiny_causal_lm(seed=3)
    load_sharded(tmp_path / "dcp", model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, res["fsdp-bf16"]["weights"][name], rtol=0, atol=0)
