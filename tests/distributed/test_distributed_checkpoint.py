"""Sharded checkpoints (DCP) written by two FSDP2 ranks load into one plain process with identical
weights and optimizer state, and one process's load on two FSDP2 ranks; the Hugging Face export loads with plain transformers; LoRA under FSDP2
trains only its adapters, checkpoints only them, and exports a merged model and a peft adapter folder
gathered from the shards."""

from __future__ import annotations

import torch
from distributed_helpers import run_ranks, tiny_causal_lm


def _train_one_step(model, world):
    from rlvr.distributed import GlobalBatch
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    g = torch.Generator().manual_seed(3 + world.rank)  # each rank its own rows
    ids = torch.randint(2, 64, (4, 10), generator=g)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[:, 4:] = True
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = StepBatch(ids, ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    policy_gradient_update(model, optimizer, batch, UpdateSpec(1, 1.0), global_batch=GlobalBatch.of(4))
    return optimizer


def _full_optimizer_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_worker(world, out):
    from rlvr.distributed.checkpoint import export_hf, save_sharded
    from rlvr.distributed.wrap import full_state_dict_on_main, wrap_model

    model = wrap_model(tiny_causal_lm(seed=0), "fsdp")
    optimizer = _train_one_step(model, world)
    save_sharded(out / "dcp", model, optimizer)
    export_hf(model, out / "hf")
    weights = full_state_dict_on_main(model)
    optim_state = _full_optimizer_state(model, optimizer)
    if world.is_main:
        torch.save({"weights": weights, "optim": optim_state}, out / "expected.pt")


def test_dcp_from_two_fsdp_ranks_loads_in_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlvr.distributed.checkpoint import load_sharded

    run_ranks(_save_worker, tmp_path)
    expected = torch.load(tmp_path / "expected.pt")
    start = tiny_causal_lm(seed=0).state_dict()
    assert any(not torch.equal(t, start[n]) for n, t in expected["weights"].items()), "the step changed nothing"

    model = tiny_causal_lm(seed=5)  # other weights, so loading has to change every one of them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded(tmp_path / "dcp", model, optimizer)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected["weights"][name]), name
    got = _full_optimizer_state(model, optimizer)["state"]
    want = expected["optim"]["state"]
    assert set(got) == set(want) and want
    for name in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(got[name][key]), torch.as_tensor(want[name][key])), (name, key)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.config.architectures == ["Olmo2ForCausalLM"]
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, expected["weights"][name]), name


def _load_worker(world, out):
    from rlvr.distributed.checkpoint import load_sharded
    from rlvr.distributed.wrap import full_state_dict_on_main, wrap_model

    model = wrap_model(tiny_causal_lm(seed=7), "fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded(out / "dcp-one-process", model, optimizer)
    weights = full_state_dict_on_main(model)
    optim_state = _full_optimizer_state(model, optimizer)
    if world.is_main:
        torch.save({"weights": weights, "optim": optim_state}, out / "loaded-on-two.pt")


def test_dcp_from_one_process_loads_on_two_fsdp_ranks(tmp_path):
    from rlvr.distributed.checkpoint import save_sharded

    model = tiny_causal_lm(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.randint(2, 64, (2, 8))).logits.square().mean().backward()
    optimizer.step()
    save_sharded(tmp_path / "dcp-one-process", model, optimizer)
    run_ranks(_load_worker, tmp_path)
    loaded = torch.load(tmp_path / "loaded-on-two.pt")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["weights"][name], tensor), name
    want = _full_optimizer_state(model, optimizer)["state"]
    for name in want:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"]["state"][name][key], want[name][key]), (name, key)


def _lora_worker(world, out):
    from rlvr.config import LoraConfig
    from rlvr.distributed.checkpoint import export_adapter, export_hf, save_sharded
    from rlvr.distributed.wrap import wrap_model
    from rlvr.training.lora import apply_lora

    torch.manual_seed(11)  # the same adapter initialisation on every rank
    model = apply_lora(
        tiny_causal_lm(seed=0), LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    )
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    model = wrap_model(model, "fsdp")
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    optimizer = _train_one_step(model, world)
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n]))
    save_sharded(out / "dcp", model, optimizer)
    export_hf(model, out / "hf")
    export_adapter(model, out / "adapter")
    if world.is_main:
        torch.save({"trainable": trainable, "changed": changed}, out / "lora.pt")


def test_lora_under_fsdp_trains_adapters_and_exports_merged(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlvr.config import LoraConfig
    from rlvr.distributed.checkpoint import load_sharded
    from rlvr.training.lora import apply_lora

    run_ranks(_lora_worker, tmp_path)
    info = torch.load(tmp_path / "lora.pt")
    assert info["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in info["trainable"])
    assert info["changed"] and set(info["changed"]) <= set(info["trainable"])

    # the adapters alone were checkpointed: rebuild base + adapters in one process and load them
    torch.manual_seed(99)
    adapted = apply_lora(
        tiny_causal_lm(seed=0), LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    )
    load_sharded(tmp_path / "dcp", adapted)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not any("lora" in n for n in merged.state_dict())
    ids = torch.randint(2, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    adapted.eval()
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base = tiny_causal_lm(seed=0).eval()(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-4, "the adapters changed nothing"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # the adapter folder, gathered from the two ranks' shards, loads with peft onto a fresh base
    from peft import PeftModel

    with torch.no_grad():
        from_adapter = PeftModel.from_pretrained(tiny_causal_lm(seed=0), tmp_path / "adapter").eval()(input_ids=ids)
    torch.testing.assert_close(from_adapter.logits, want, rtol=1e-5, atol=1e-5)
