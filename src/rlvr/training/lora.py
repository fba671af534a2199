"""LoRA through peft: adapters added at model load, only they train, and a merged plain model for
export and for the rollout engines.

``apply_lora(model, config.model.lora)`` returns a ``peft.PeftModel`` whose base weights are frozen
(rank 0 leaves the model as it is). ``merge_lora`` gives back a plain transformers model with the
adapters folded into the base weights (``W + alpha/rank · B A``), which ``save_pretrained`` writes as
an ordinary checkpoint; under FSDP2 use ``rlvr.distributed.export_hf``, which merges tensor by
tensor from the shards.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, cast

from torch import nn

from rlvr.config import LoraConfig
from rlvr.errors import UserError


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """``model`` with LoRA adapters on ``lora.target_modules`` (a ``peft.PeftModel``; the base
    weights frozen), or ``model`` itself when ``lora.rank`` is 0."""
    if not lora.rank:
        return model
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as e:
        raise UserError("model.lora needs the peft package: pip install peft") from e
    targets: str | list[str] = list(lora.target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    # peft annotates lora_alpha as int, but any positive number works: the scale is alpha / rank.
    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config)


def is_lora(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def merge_lora(model: nn.Module, copy_model: bool = True) -> nn.Module:
    """A plain transformers model with the adapters merged in (a copy unless ``copy_model`` is False,
    which merges in place and unloads the adapters from ``model``). Models without adapters come back
    as they are. One process, unsharded; for FSDP2 see ``rlvr.distributed.export_hf``."""
    if not is_lora(model):
        return model
    target: Any = copy.deepcopy(model) if copy_model else model
    return target.merge_and_unload()


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def adapters_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """A context in which ``model`` (a peft model, maybe inside DDP; FSDP2 shards it in place) computes
    as its base model: the adapters are turned off through peft's ``disable_adapter``."""
    inner = getattr(model, "module", model)  # DDP keeps the model as .module
    if not is_lora(inner):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to turn off")
    return cast(Any, inner).disable_adapter()
