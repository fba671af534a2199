"""Per-token log-probabilities and entropies of a causal LM, without a full float32 logits tensor.

The vocabulary projection is applied to chunks of ``chunk_tokens`` hidden states at a time; each
chunk is upcast to float32, reduced to (log-prob of the label, entropy) and dropped. For a plain
``Linear`` head this is one fused autograd function (``fused_logprobs.linear_log_probs``) whose
backward recomputes each chunk's logits from the saved hidden states; models with post-processed
logits fall back to their own logits, reduced chunk by chunk under activation checkpointing. At
OLMo-2-1B's vocabulary (100,352) one chunk of 2,048 tokens is 0.8 GB in float32, against 13 GB for
a 32-sequence × 1024-token microbatch.

``positions`` (the response mask, for the policy-gradient update) restricts the vocabulary projection
to the tokens whose log-probs are used: prompt and padding tokens still pass through the backbone
(later tokens attend to them) but not through the head, which at a small model's size is one of its
largest matmuls, done four times per token in a training step.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rlvr.training.fused_logprobs import DEFAULT_CHUNK_TOKENS, linear_log_probs


def _stats_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z
    if want_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = log_z - (probs * logits).sum(-1)
    else:
        entropy = log_z.new_zeros(())
    return log_probs, entropy


def _lm_head(model: torch.nn.Module, allow_sharded: bool = False) -> torch.nn.Linear | None:
    """The output projection when logits are a plain ``Linear`` of the last hidden state, else None.

    Models that post-process logits (soft-capping, logit scaling) fall back to the model's own
    logits, still reduced chunk by chunk in float32. Data-parallel wrappers (DDP, FSDP2) get None
    here and take the fused pass through their own hooks (``_wrapped_fused_call``).
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and not allow_sharded:
        # The root's parameters are gathered by its forward methods: reading the head's weight outside
        # them would see a shard (``enable_fused_log_probs`` registers one that uses the head).
        return None
    cfg = getattr(model, "config", None)
    if (
        cfg is None
        or getattr(cfg, "final_logit_softcapping", None)
        or getattr(cfg, "logit_scale", None) not in (None, 1.0)
    ):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    backbone = getattr(model, "base_model", None)
    if type(head) is not torch.nn.Linear or backbone is None or backbone is model:
        return None
    return head


def model_device(model: torch.nn.Module) -> torch.device:
    """The device ``model`` computes on: its parameters' device, or, for parameters that FSDP2 keeps
    offloaded on the CPU, the device of their mesh (where each layer is gathered to run)."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or mesh.device_type == param.device.type:
        return param.device
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _peft_base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper, whose own layers hold the adapters, so its
    backbone and head compute what the wrapper does; any other model as it is."""
    peft = sys.modules.get("peft")  # a model cannot be a PeftModel if peft was never imported
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    return model.get_base_model()


def _without_peft(model: torch.nn.Module) -> torch.nn.Module:
    """``_peft_base``, except that a sharded (FSDP2) peft root stays whole: its forward methods are
    what gather its parameters."""
    from torch.distributed.fsdp import FSDPModule

    return model if isinstance(model, FSDPModule) else _peft_base(model)


def _fused_log_probs(
    model: torch.nn.Module,
    head: torch.nn.Linear,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    kwargs: dict,
    chunk_tokens: int,
    return_token_entropy: bool,
    backbone: Callable[..., Any] | None = None,
    keep: torch.Tensor | None = None,
    keep_logits: bool = False,
) -> dict[str, torch.Tensor]:
    """Log-probs through the backbone and the chunked fused head (``linear_log_probs``); with ``keep``
    (indices into the flattened (B*T) positions, on the device) the head sees only those positions,
    and every other position gets 0. ``keep_logits`` as in ``linear_log_probs``."""
    rows = input_ids.shape[0]
    if backbone is not None:
        # A compiled backbone guards on its inputs' layout (a view of a larger tensor and a fresh one
        # compile differently) and specialises on a batch of one (PyTorch's 0/1 specialisation): fresh
        # contiguous inputs, and a second, discarded copy of a lone row, keep it on one graph.
        copies = 2 if rows == 1 else 1
        input_ids = input_ids.repeat(copies, 1)
        kwargs = {k: v.repeat(copies, 1) for k, v in kwargs.items()}
    hidden = (model.base_model if backbone is None else backbone)(  # type: ignore[operator]  # transformers' backbone
        input_ids=input_ids, use_cache=False, **kwargs
    ).last_hidden_state[:rows]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    if keep is not None:
        flat_h = flat_h.index_select(0, keep)
    return head_log_probs(
        head, flat_h, labels, keep, chunk_tokens, return_token_entropy, backbone is not None, keep_logits
    )


def head_log_probs(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    keep: torch.Tensor | None,
    chunk_tokens: int,
    return_token_entropy: bool,
    compiled: bool,
    keep_logits: bool = False,
) -> dict[str, torch.Tensor]:
    """The fused head over ``hidden``: one row per position of ``labels`` (B, T), or, with ``keep``
    (indices into the flattened positions), one row per kept position, every other position 0.
    ``keep_logits`` as in ``linear_log_probs``."""
    flat_y = labels.reshape(-1)
    if keep is not None:
        flat_y = flat_y.index_select(0, keep)
    lp, ent = linear_log_probs(
        hidden, head.weight, head.bias, flat_y, chunk_tokens, return_token_entropy, compiled, keep_logits
    )
    if keep is not None:
        lp = _scatter(lp, keep, labels.numel())
        if return_token_entropy:
            ent = _scatter(ent, keep, labels.numel())
    out = {"log_probs": lp.view_as(labels)}
    if return_token_entropy:
        out["token_entropy"] = ent.view_as(labels)
    return out


def _scatter(values: torch.Tensor, keep: torch.Tensor, n: int) -> torch.Tensor:
    """``values`` of the kept positions placed in a zero vector of all ``n`` positions (differentiable)."""
    return values.new_zeros(n).index_copy(0, keep, values)


def _kept_positions(positions: torch.Tensor, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Indices of the True entries of ``positions`` in the flattened (B*T) layout, on ``device``. Found
    on the host when the mask is there, so no device sync is needed for the result's size."""
    if positions.shape != shape:
        raise ValueError(
            f"positions has shape {tuple(positions.shape)} but labels have {tuple(shape)}; they must match"
        )
    return positions.reshape(-1).nonzero().squeeze(1).to(device, non_blocking=True)


FUSED_METHOD = "rlvr_fused_log_probs"


def _fused_forward(
    self: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    kwargs: dict,
    chunk_tokens: int,
    return_token_entropy: bool,
    keep: torch.Tensor | None = None,
    keep_logits: bool = False,
) -> dict[str, torch.Tensor]:
    """The fused log-prob pass as a method of the model (peft wrapper or not) that a data-parallel
    wrapper runs in place of ``forward``: the wrapper's hooks then see it as the model's forward."""
    plain = _peft_base(self)
    out = _fused_log_probs(
        plain,
        plain.get_output_embeddings(),  # type: ignore[operator]  # a transformers model's head
        input_ids,
        labels,
        kwargs,
        chunk_tokens,
        return_token_entropy,
        keep=keep,
        keep_logits=keep_logits,
    )
    # FSDP2 hooks the backward through the returned tensors; fresh ones (not views) keep an in-place
    # change by a caller from detaching that hook.
    return {k: v.clone() for k, v in out.items()}


def enable_fused_log_probs(model: torch.nn.Module) -> bool:
    """Let an FSDP2-sharded model use the fused head: registers ``_fused_forward`` as one of its
    forward methods (``register_fsdp_forward_method``), so the root's parameters are gathered for it
    and its gradients reduced after it like a forward's. False (and nothing done) when the model's
    logits are not a plain ``Linear`` of its backbone's output."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if _lm_head(_peft_base(model), allow_sharded=True) is None:
        return False
    setattr(model, FUSED_METHOD, types.MethodType(_fused_forward, model))
    register_fsdp_forward_method(model, FUSED_METHOD)
    return True


def _wrapped_fused_call(model: torch.nn.Module) -> Callable[..., dict[str, torch.Tensor]] | None:
    """The fused pass run through a data-parallel wrapper, so the wrapper's hooks see it as the
    model's forward: the method ``enable_fused_log_probs`` registered on an FSDP2 root, or, under DDP,
    the inner model's ``forward`` pointed at ``_fused_forward`` for one call. None otherwise."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        return getattr(model, FUSED_METHOD, None)
    if not isinstance(model, DistributedDataParallel) or _lm_head(_peft_base(model.module)) is None:
        return None
    inner = model.module

    def call(*args: Any) -> dict[str, torch.Tensor]:  # ``_fused_forward``'s arguments after ``self``
        had_own = "forward" in inner.__dict__
        own = inner.__dict__.get("forward")
        inner.forward = types.MethodType(_fused_forward, inner)
        try:
            return model(*args)
        finally:
            if had_own:
                inner.forward = own
            else:
                del inner.forward

    return call


def inductor_options() -> dict | None:
    """Inductor settings for the training compile. Inductor fuses a norm's backward row and column
    reductions ("mix-order reduction") only above some microbatch sizes, and with dynamic shapes each
    such decision becomes a guard on the size: a microbatch on the other side of a threshold compiles
    the layer again in the middle of a run (a stall of seconds, docs/benchmarks.md). The non-strict mode skips those size checks, so one graph serves every
    microbatch. None where this torch has no such setting."""
    import torch._inductor.config as config

    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return None


class LayerwiseCompiledBackbone:
    """``model.base_model`` with every decoder layer run through one ``torch.compile``d layer forward.

    The decoder layers share their code, so the layer forward is compiled once (parameters are graph
    inputs) and reused by all of them: compiling takes about one layer's time instead of the whole
    stack's, while the norms, rotary embeddings, attention glue and activations inside each layer are
    still fused. During a call each layer's ``forward`` is pointed at the compiled function and put
    back afterwards, so the model's modules, names and state dict never change and the rollout
    engines, which call the same modules between training steps, run them eagerly.
    """

    def __init__(self, model: torch.nn.Module, dynamic: bool = True) -> None:
        # transformers' backbone (``model.base_model``): its decoder layers are read by name.
        self.base_model: Any = model.base_model
        self.layers = list(self.base_model.layers)  # type: ignore[union-attr, arg-type]
        kinds = {type(layer) for layer in self.layers}
        if len(kinds) != 1:
            raise ValueError(
                f"layer-wise compile needs one decoder layer class, got {sorted(k.__name__ for k in kinds)}"
            )
        self.compiled_forward = torch.compile(kinds.pop().forward, dynamic=dynamic, options=inductor_options())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for layer in self.layers:
            layer.forward = types.MethodType(self.compiled_forward, layer)
        try:
            return self.base_model(*args, **kwargs)
        finally:
            for layer in self.layers:
                del layer.forward


def compile_backbone(model: torch.nn.Module, dynamic: bool = True) -> Any:
    """A compiled stand-in for the model's backbone (``model.base_model``), for ``backbone=`` below.

    Models whose backbone keeps its decoder layers in ``base_model.layers`` (OLMo-2, Llama, Qwen and
    most causal LMs in transformers) get a ``LayerwiseCompiledBackbone``; others get
    ``torch.compile(model.base_model)``. Either shares the model's parameters, so optimizer steps are
    seen at once, and leaves the model itself as it is. ``dynamic=True`` compiles for symbolic batch
    and sequence sizes once, instead of once per microbatch shape.
    """
    if _lm_head(model) is None:
        raise ValueError(
            f"model.compile needs a model whose logits are a plain Linear of model.base_model's output; "
            f"{type(model).__name__} is not one (wrapped, soft-capped or scaled logits): set model.compile to false"
        )
    if isinstance(getattr(model.base_model, "layers", None), torch.nn.ModuleList) and len(model.base_model.layers):  # type: ignore[union-attr, arg-type]
        return LayerwiseCompiledBackbone(model, dynamic=dynamic)
    return torch.compile(model.base_model, dynamic=dynamic, options=inductor_options())  # type: ignore[arg-type]


def get_response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    attention_mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    position_ids: torch.Tensor | None = None,
    backbone: Callable[..., Any] | None = None,
    positions: torch.Tensor | None = None,
    keep_logits: bool = False,
) -> dict[str, torch.Tensor]:
    """``log_probs`` (B, T): log p(labels[b, t] | input_ids[b, :t+1]); with the flag, ``token_entropy``
    (B, T): entropy of the next-token distribution at t (differentiable too: an entropy bonus; detach it
    for a diagnostic).

    Numerically stable (logsumexp in float32). Gradients flow into ``log_probs`` when grad is enabled.
    ``backbone``: a stand-in for ``model.base_model`` with the same parameters (``compile_backbone``).
    ``positions`` (B, T) bool, best on the host: only these positions' log-probs and entropies are
    computed (the response mask: the vocabulary projection skips prompt and padding tokens); every
    other position holds 0 in both outputs, and its label is never read. ``keep_logits``: the fused
    head keeps its logits for the backward instead of recomputing them (``linear_log_probs``).
    """
    model = _without_peft(model)
    device = model_device(model)
    # Not waiting for the device: the host prepares the next microbatch while the last one runs.
    input_ids = input_ids.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids.to(device)
    keep = None if positions is None else _kept_positions(positions, labels.shape, device)
    wrapped = _wrapped_fused_call(model)
    if wrapped is not None and backbone is None:
        return wrapped(input_ids, labels, kwargs, chunk_tokens, return_token_entropy, keep, keep_logits)
    head = _lm_head(model)
    if head is not None:
        return _fused_log_probs(
            model, head, input_ids, labels, kwargs, chunk_tokens, return_token_entropy, backbone, keep, keep_logits
        )
    logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    flat_z, flat_y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if keep is not None:
        flat_z, flat_y = flat_z.index_select(0, keep), flat_y.index_select(0, keep)
    use_ckpt = torch.is_grad_enabled() and flat_z.requires_grad
    log_probs, entropies = [], []
    for start in range(0, flat_y.numel(), chunk_tokens):
        z, y = flat_z[start : start + chunk_tokens], flat_y[start : start + chunk_tokens]
        if use_ckpt:
            lp, ent = checkpoint(_stats_from_logits, z, y, return_token_entropy, use_reentrant=False)
        else:
            lp, ent = _stats_from_logits(z, y, return_token_entropy)
        log_probs.append(lp)
        entropies.append(ent)
    lp_all, ent_all = torch.cat(log_probs), torch.cat(entropies) if return_token_entropy else None
    if keep is not None:
        lp_all = _scatter(lp_all, keep, labels.numel())
        ent_all = _scatter(ent_all, keep, labels.numel()) if ent_all is not None else None
    out = {"log_probs": lp_all.view_as(labels)}
    if ent_all is not None:
        out["token_entropy"] = ent_all.view_as(labels)
    return out


@torch.no_grad()
def compute_log_probs_batched(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log_probs`` for a large batch in slices of ``batch_size`` rows (no grad), on the model's device.

    Used for old log-probs (the sampling policy's) in off-policy training; ``positions`` as in
    ``get_response_log_probs`` (0 elsewhere).
    """
    outs = []
    for start in range(0, input_ids.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        part = None if positions is None else positions[sl]
        outs.append(
            get_response_log_probs(model, input_ids[sl], labels[sl], chunk_tokens=chunk_tokens, positions=part)[
                "log_probs"
            ]
        )
    return torch.cat(outs)
