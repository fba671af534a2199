"""LoRA through peft in one process: the config section, only adapters train, the policy-gradient
update works on a peft model, and the merged export loads with plain transformers and gives the
adapted model's logits."""

from __future__ import annotations

import pytest
import torch
from distributed_helpers import tiny_causal_lm

from rlvr.checks import resolve_config, validate_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_config_section():
    from rlvr.commands.train import parse_command
    from rlvr.config import ConfigError, LoraConfig, TrainConfig

    assert TrainConfig().model.lora.rank == 0
    config = TrainConfig.from_dict(
        {"model": {"lora": {"rank": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}}}
    )
    assert config.model.lora == LoraConfig(rank=8, alpha=16.0, dropout=0.05, target_modules=("q_proj", "v_proj"))
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert parse_command(["--model.lora.rank", "4", "--out", "run"])[0].model.lora.rank == 4
    with pytest.raises(ConfigError, match="model.lora.rank must be >= 0"):
        LoraConfig(rank=-2)
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        TrainConfig.from_dict({"model": {"lora": {"rank": 4, "dropout": 1.5}}})


def test_rank_zero_leaves_the_model_alone():
    from rlvr.config import LoraConfig
    from rlvr.training.lora import apply_lora

    model = tiny_causal_lm()
    assert apply_lora(model, LoraConfig()) is model


def _adapted(rank: int = 4, targets=TARGETS):
    from rlvr.config import LoraConfig
    from rlvr.training.lora import apply_lora

    torch.manual_seed(0)
    return apply_lora(tiny_causal_lm(seed=0), LoraConfig(rank=rank, alpha=8, target_modules=targets))


def test_only_adapters_train_and_the_update_moves_them():
    from rlvr.training.lora import trainable_parameters
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    model = _adapted()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    n_trainable, n_total = trainable_parameters(model)
    assert 0 < n_trainable < n_total / 5
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(2, 64, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[:, 4:] = True
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = StepBatch(ids, ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    _, meta = policy_gradient_update(model, optimizer, batch, UpdateSpec(2, 1.0))
    assert meta["grad_norm"] > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable


def test_merged_export_gives_the_adapted_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlvr.distributed.checkpoint import export_hf
    from rlvr.distributed.wrap import iter_full_weights
    from rlvr.training.lora import merge_lora

    model = _adapted()
    with torch.no_grad():  # adapters as if trained: B starts at zero, which would merge to nothing
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    export_hf(model, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(merged).__name__ == "Olmo2ForCausalLM"
    names = set(merged.state_dict())
    assert names == set(tiny_causal_lm().state_dict())
    ids = torch.randint(2, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base = tiny_causal_lm(seed=0)(input_ids=ids).logits
        peft_merged = merge_lora(model)(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(peft_merged, want, rtol=1e-5, atol=1e-5)
    # the stream an engine sync reads: plain names, merged values
    streamed = dict(iter_full_weights(model))
    assert set(streamed) == names
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(streamed[name], tensor)


def test_adapters_added_at_load(tmp_path, tiny_model, tiny_tokenizer):
    from rlvr.config import LoraConfig
    from rlvr.modeling import load_model_and_tokenizer, save_model_and_tokenizer
    from rlvr.training.lora import is_lora

    save_model_and_tokenizer(tiny_model, tiny_tokenizer, tmp_path / "m")
    plain, _ = load_model_and_tokenizer(tmp_path / "m")
    assert not is_lora(plain)
    model, _ = load_model_and_tokenizer(tmp_path / "m", lora=LoraConfig(rank=2, target_modules=("q_proj",)))
    assert is_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * tiny_model.config.num_hidden_layers and all("q_proj.lora_" in n for n in trainable)


def test_train_accepts_lora():
    from rlvr.config import TrainConfig

    config = resolve_config(TrainConfig.from_dict({"model": {"lora": {"rank": 4}}}))
    validate_config(config)
    assert config.model.lora.rank == 4


def test_lora_with_model_compile_is_a_clear_error():
    from rlvr.config import ConfigError, TrainConfig

    config = resolve_config(TrainConfig.from_dict({"model": {"lora": {"rank": 4}, "compile": True}}))
    with pytest.raises(ConfigError, match="model.compile does not run LoRA models"):
        validate_config(config)
