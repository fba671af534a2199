"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and one Hugging Face export.

``save_sharded`` writes the model and optimizer state as DCP does: every rank writes its own shards,
and the metadata records each tensor's global shape, so ``load_sharded`` can read the checkpoint
into any number of ranks (FSDP2 with another world size, DDP, or one plain process). Both go through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``, which name model
and optimizer entries by the parameters' plain names whatever the wrapper, so a checkpoint written by
a wrapped model loads into an unwrapped one and back. With LoRA (peft) only the trainable tensors
(the adapters) and their optimizer state are saved.

``export_hf`` writes one ``save_pretrained`` folder (LoRA merged) that transformers and vLLM load;
``export_adapter`` the LoRA adapters alone as a folder that ``peft.PeftModel.from_pretrained`` loads
onto the base model.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlvr.distributed.wrap import adapter_state_dict_on_main, full_state_dict_on_main, unwrap_model

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from transformers import PreTrainedTokenizerBase


def _options(trainable_only: bool) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Without the frozen parameters the checkpoint covers only part of the model, so loading must
    # not insist on every key.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _has_frozen(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def save_sharded(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool | None = None,
) -> Path:
    """Write ``model`` (and ``optimizer``) to the DCP folder ``path``; every rank must call it.

    ``trainable_only`` (default: whenever some parameters are frozen, as with LoRA) leaves out
    frozen parameters, which the run rebuilds from its base model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    path = Path(path)
    only = _has_frozen(model) if trainable_only is None else trainable_only
    state: dict[str, Any]
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=_options(only))}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=_options(only))
        state = {"model": model_state, "optim": optim_state}
    dcp.save(state, checkpoint_id=str(path))
    return path


def load_sharded(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool | None = None,
) -> None:
    """Read the DCP folder ``path`` into ``model`` (and ``optimizer``) in place, whatever the number
    of ranks or the wrapper that wrote it; every rank must call it. The optimizer must already hold
    its parameters (its state is filled from the checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    only = _has_frozen(model) if trainable_only is None else trainable_only
    options = _options(only)
    state: dict[str, Any]
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=options)
        return
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def export_hf(
    model: nn.Module, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None = None, merge_lora: bool = True
) -> Path | None:
    """One Hugging Face folder with the full weights (LoRA adapters merged), written by rank 0 from
    weights gathered tensor by tensor; every rank must call it. Returns the folder on rank 0."""
    state = full_state_dict_on_main(model, merge_lora=merge_lora)
    if state is None:
        return None
    plain: Any = unwrap_model(model)
    if hasattr(plain, "get_base_model"):  # peft: the base model's class and config describe the merged weights
        plain = plain.get_base_model()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out_dir), state_dict=state)
    # fully_shard swaps the class for a generated FSDP subclass; readers such as vLLM pick the model
    # class from the name recorded in config.json, so record the original one.
    original = next(c for c in type(plain).__mro__ if not c.__name__.startswith("FSDP"))
    plain.config.architectures = [original.__name__]
    plain.config.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def export_adapter(model: nn.Module, out_dir: str | Path) -> Path | None:
    """The active LoRA adapter of a peft model (maybe inside DDP or sharded by FSDP2) as a peft folder
    (``adapter_config.json``, ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained``
    loads onto the base model, written by rank 0 from the adapter tensors gathered one at a time;
    every rank must call it. Returns the folder on rank 0."""
    from safetensors.torch import save_file

    state = adapter_state_dict_on_main(model)
    if state is None:
        return None
    peft_model: Any = unwrap_model(model)
    adapter = peft_model.active_adapter
    # peft's folder names each tensor without the adapter's name (``...q_proj.lora_A.weight``). The
    # renaming is done here rather than by peft's save_pretrained, which finds its tensors by module
    # name and so finds none once a checkpoint wrapper renames the modules (FSDP2 with checkpointing).
    in_file = re.compile(rf"\.(lora_\w+)\.{re.escape(adapter)}(?=\.|$)")
    weights = {}
    for name, tensor in state.items():
        key = in_file.sub(r".\1", name)
        if key != name:
            weights[key] = tensor.contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Saved for inference, as peft saves it; PeftModel.from_pretrained(..., is_trainable=True) trains it on.
    saved_config = copy.copy(peft_model.peft_config[adapter])
    saved_config.inference_mode = True
    saved_config.save_pretrained(str(out_dir))
    save_file(weights, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir
