"""Wrapping the policy for data-parallel training (DDP or FSDP2), and reading full weights back.

``wrap_model(model, "fsdp")`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer
and then to the root, so parameters, gradients and optimizer state are sharded over the ranks and a
layer's full weights exist only while it runs. ``"ddp"`` keeps a full replica per rank
(``DistributedDataParallel``). Both average gradients over the ranks, which is what
``rlvr.distributed.GlobalBatch`` assumes.

``iter_full_weights`` yields the model's weights under their Hugging Face names, one full tensor at
a time, on the rank's device: under FSDP2 each is all-gathered when its turn comes, so a weight sync
to the rollout engines needs one tensor of extra memory, never a copy of the model. LoRA adapters
(peft) are merged into their base weights on the way, so engines receive a plain model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from rlvr.training.logprobs import enable_fused_log_probs

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

Strategy = Literal["ddp", "fsdp"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 wraps in place, so an FSDP model is itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model, found without knowing its family: the modules
    whose class transformers names as not to be split across devices (``_no_split_modules``), else
    the longest ``ModuleList`` of one class. Works through peft and DDP wrappers."""
    model = unwrap_model(model)
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists: list[nn.ModuleList] = [
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
    ]
    if not lists:
        raise ValueError(
            f"found no decoder layers in {type(model).__name__}: no _no_split_modules and no ModuleList of one class"
        )
    longest = lists[0]
    for candidate in lists[1:]:
        if len(candidate) > len(longest):
            longest = candidate
    return list(longest)


def wrap_model(
    model: nn.Module,
    strategy: Strategy,
    device: torch.device | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """``model`` ready for data-parallel training over the default process group.

    ``ddp``: a ``DistributedDataParallel`` replica (``device``: the rank's device). Buffers are not
    broadcast at every forward (the rotary tables are the same on every rank), so a forward is not a
    collective and ranks may run different numbers of them outside training.

    ``fsdp``: FSDP2 ``fully_shard`` on each decoder layer, then on the root; returns the same
    (now sharded) module. ``param_dtype`` is the dtype layers compute in (e.g. bfloat16 while the
    sharded parameters, and so AdamW's state, stay float32), ``reduce_dtype`` that of the gradient
    reduce-scatter (float32 by default). ``cpu_offload`` keeps the sharded parameters, gradients and
    optimizer state on the CPU (the optimizer step runs there) and copies each layer to the GPU for
    its forward and backward. ``activation_checkpointing`` (fsdp): each decoder layer recomputes its
    activations in the backward, through ``checkpoint_wrapper`` applied before ``fully_shard`` so that
    the layer's all-gather stays outside the recomputed region (transformers' own
    ``gradient_checkpointing_enable`` puts it inside). Every rank must hold the same (full) weights
    before wrapping.
    """
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if device is not None and device.type == "cuda":
            return DistributedDataParallel(model, device_ids=[device.index], broadcast_buffers=False)
        return DistributedDataParallel(model, broadcast_buffers=False)
    if strategy != "fsdp":
        raise ValueError(f"unknown data-parallel strategy {strategy!r}: use 'ddp' or 'fsdp'")
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory speeds the copies to a GPU; without one there is nothing to pin.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    layers = _checkpointed_layers(model) if activation_checkpointing else decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    # The root keeps embeddings, final norm and head; it is gathered for the whole forward anyway.
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)

    enable_fused_log_probs(model)
    return model


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """Replace every decoder layer by a non-reentrant ``checkpoint_wrapper`` around it, in place, and
    return the wrappers. Their state dicts keep the plain names (the wrapper strips its prefix)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    targets = {id(layer) for layer in decoder_layers(model)}
    wrappers: list[nn.Module] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapper = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                setattr(parent, name, wrapper)
                wrappers.append(wrapper)
    return wrappers


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _hf_name(name: str) -> str:
    """A peft model's state-dict name as the plain model names it."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _lora_layers(model: nn.Module) -> dict[str, Any]:
    """peft LoRA layers by their name in ``model``'s state dict (empty for a model without adapters)."""
    if "peft" not in sys.modules:  # no adapters without peft having been imported
        return {}
    from peft.tuners.lora import LoraLayer

    # Module names as the state dict spells them: a checkpoint wrapper's own level is left out there.
    return {
        name.replace("_checkpoint_wrapped_module.", ""): m
        for name, m in model.named_modules()
        if isinstance(m, LoraLayer)
    }


@torch.no_grad()
def iter_full_weights(model: nn.Module, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every entry of the model's state dict, in its order, under the
    plain Hugging Face names; one tensor materialised at a time, on the device it lives on.

    Under FSDP2 every rank must iterate to the end together (each tensor is an all-gather); ranks
    that do not need the weights simply drop them. With LoRA (peft) adapters and ``merge_lora``, a
    layer's base weight comes out merged (``W + scale · B A`` of the active adapters) and the
    adapter tensors themselves are not yielded; without ``merge_lora`` every tensor is yielded
    under its peft name.
    """
    model = unwrap_model(model)
    state = model.state_dict()
    lora = _lora_layers(model) if merge_lora else {}
    if not lora:
        for name, tensor in state.items():
            yield name, _full(tensor)
        return
    adapter_prefixes = {f"{name}.lora_" for name in lora} | {f"{name}.lora_magnitude_vector" for name in lora}
    for name, tensor in state.items():
        if any(name.startswith(p) for p in adapter_prefixes):
            continue  # merged into the base weight, gathered when that weight is
        full = _full(tensor)
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if owner in lora and name.endswith(".base_layer.weight"):
            full = full + _lora_delta(lora[owner], state, owner).to(full.dtype)
        yield _hf_name(name), full


def _lora_delta(layer: LoraLayer, state: dict[str, torch.Tensor], owner: str) -> torch.Tensor:
    """``scale · B A`` summed over the layer's active adapters, from full (gathered) adapter weights."""
    if getattr(layer, "use_dora", {}) and any(layer.use_dora.values()):
        raise NotImplementedError("merging DoRA adapters while sharded is not supported; use plain LoRA")
    delta = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = _full(state[f"{owner}.lora_A.{adapter}.weight"]).float()
        b = _full(state[f"{owner}.lora_B.{adapter}.weight"]).float()
        d = (b @ a) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            d = d.T
        delta = d if delta is None else delta + d
    if delta is None:
        return torch.zeros((), device=_full(state[f"{owner}.base_layer.weight"]).device)
    return delta


@torch.no_grad()
def copy_full_weights(source: nn.Module, target: nn.Module) -> int:
    """Copy ``source``'s full weights (DDP, FSDP2 or peft: LoRA merged) into the plain model
    ``target`` (e.g. an in-process engine's own copy, in its own dtype), tensor by tensor; every rank
    must call it. Returns the number of tensors copied; names or shapes that do not match raise
    ``ValueError`` (before a collective is left half done, the others are still iterated)."""
    dest = target.state_dict()
    copied, problems = set(), []
    for name, tensor in iter_full_weights(source):
        if name not in dest:
            problems.append(f"{name} is not in the target")
        elif dest[name].shape != tensor.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)} into {tuple(dest[name].shape)}")
        else:
            dest[name].copy_(tensor)
            copied.add(name)
    missing = sorted(set(dest) - copied - {p.split(" ")[0] for p in problems})
    if missing:
        problems.append(f"not in the source: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if problems:
        raise ValueError("the weights do not fit the target model: " + "; ".join(problems[:5]))
    return len(copied)


def adapter_state_dict_on_main(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The LoRA adapter tensors alone (peft names), on the CPU, on rank 0 (None elsewhere): each is
    gathered in the same order on every rank and the frozen base weights are never gathered. Every
    rank must call it."""
    import torch.distributed as dist

    main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    out: dict[str, torch.Tensor] | None = {} if main else None
    for name, tensor in unwrap_model(model).state_dict().items():
        if ".lora_" not in name:
            continue
        full = _full(tensor)
        if out is not None:
            out[name] = full.detach().to("cpu", copy=True)
    return out


def full_state_dict_on_main(model: nn.Module, merge_lora: bool = True) -> dict[str, torch.Tensor] | None:
    """The full weights, on the CPU, on rank 0 (None elsewhere), gathered tensor by tensor: for a
    Hugging Face export. Every rank must call it."""
    import torch.distributed as dist

    main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    out: dict[str, torch.Tensor] | None = {} if main else None
    for name, tensor in iter_full_weights(model, merge_lora=merge_lora):
        if out is not None:
            out[name] = tensor.detach().to("cpu", copy=True)
    return out
