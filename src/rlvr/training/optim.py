"""AdamW (and RMSprop, for DPO) that keep float32 master weights for a bfloat16 / float16 policy.

Stepping AdamW directly on bfloat16 weights loses every update smaller than half a bfloat16 ulp of
the weight: with 8 significant bits, a weight of 0.02 moves only by multiples of 1.2e-4, while an
AdamW step at lr 1e-5 is about 1e-5. At the course's learning rate most weights would never change.
``MasterWeightAdamW`` steps float32 copies of the low-precision parameters (with float32 moments)
and writes the rounded result back into the model after every step, so small updates accumulate in
the copy until they move the bfloat16 weight. Float32 parameters are stepped in place as usual.
Memory: 4 bytes per low-precision parameter for the copy, plus float32 instead of bfloat16 moments.

``lr_factor`` is the learning-rate schedule of every rlvr trainer (GRPO, SFT, DPO's warm starts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, overload

import torch


def lr_factor(update: int, total_updates: int, schedule: str, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``update`` (0-based): linear warmup over ``warmup``
    steps, then ``constant``, ``cosine`` or ``linear`` decay to ``min_ratio`` at ``total_updates``."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - min_ratio) * progress


def lr_schedule(
    optimizer: torch.optim.Optimizer, total_updates: int, schedule: str, warmup: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_factor``'s schedule over ``optimizer``'s peak lr; ``step()`` it after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: lr_factor(u, total_updates, schedule, warmup, min_ratio)
    )


class _MasterWeights(torch.optim.Optimizer):
    """Mixin over a ``torch.optim`` class: the optimizer steps float32 masters of the given
    parameters (same arguments as the optimizer).

    Gradients are read from the model's parameters at ``step`` (after any clipping) and released
    there; ``zero_grad`` clears both. The masters travel in ``state_dict``, so a resumed run continues from the exact
    float32 values, not from their rounded copies in the model.
    """

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        self.model_params = list(params)
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.model_params]
        super().__init__(self.masters, **kwargs)

    # The base class's overloads; the closure form raises (ValueError below), hence NoReturn.
    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError(f"{type(self).__name__} does not take a closure")
        for p, m in zip(self.model_params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                # Freed as soon as it is copied, so the low-precision and float32 gradients of the
                # whole model never coexist: at 8B that is the difference between fitting and not.
                p.grad = None
        super().step()
        for p, m in zip(self.model_params, self.masters):
            if m is not p:
                p.copy_(m)
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["master_weights"] = [None if m is p else m.detach().cpu() for p, m in zip(self.model_params, self.masters)]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        if saved is not None:
            if len(saved) != len(self.masters):
                raise ValueError(f"the checkpoint holds {len(saved)} master weights for {len(self.masters)} parameters")
            with torch.no_grad():
                for p, m, s in zip(self.model_params, self.masters, saved):
                    if s is not None and m is not p:
                        m.copy_(s)
                        p.copy_(m)


class MasterWeightAdamW(_MasterWeights, torch.optim.AdamW):
    """``torch.optim.AdamW`` over float32 masters of the given parameters (same arguments)."""


class MasterWeightRMSprop(_MasterWeights, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` over float32 masters of the given parameters (same arguments)."""


def make_rmsprop(params: Iterable[torch.Tensor], master_weights: bool = True, **kwargs: Any) -> torch.optim.RMSprop:
    """RMSprop (DPO's optimizer): ``MasterWeightRMSprop`` when asked and some parameter is not float32."""
    params = [p for p in params if p.requires_grad]
    if master_weights and any(p.dtype != torch.float32 for p in params):
        # The per-tensor update: the multi-tensor one allocates temporaries the size of all the state at
        # once, which at 8B is what stops DPO with master weights fitting on one GPU beside its reference;
        # per step it measured no slower there (docs/benchmarks.md).
        kwargs.setdefault("foreach", False)
        return MasterWeightRMSprop(params, **kwargs)
    return torch.optim.RMSprop(params, **kwargs)


def make_adamw(params: Iterable[torch.Tensor], master_weights: bool = True, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW for the trainer: ``MasterWeightAdamW`` when asked and some parameter is not float32."""
    params = [p for p in params if p.requires_grad]
    if master_weights and any(p.dtype != torch.float32 for p in params):
        return MasterWeightAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
