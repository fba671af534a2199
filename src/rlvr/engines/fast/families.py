"""The model families hf-fast runs, and the layout of one model's decoder layers.

A family is one row of ``FAMILIES``: where a decoder layer puts its RMS norms, whether queries and
keys are normalised (over all heads at once, or per head), and how its norms and rotary embedding
round in low precision. Everything else is read from the model's config (heads, key/value heads,
head_dim, RMS eps, layers) or from its modules (biases, tied embeddings), so supporting another
family of the same shape is one entry here.

Module names are the ones every supported family shares in transformers: ``model.model.layers[i]``
with ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, the norms named below, and
``model.model.{embed_tokens,norm,rotary_emb}``, ``model.lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlvr.errors import UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Family:
    name: str
    """As users know it (error messages, docs)."""
    model_class: str
    """The transformers class of the causal LM."""
    norms: str
    """``"pre"``: x + attn(norm(x)), then x + mlp(norm(x)) (Llama, Qwen). ``"post"``: x + norm(attn(x)),
    then x + norm(mlp(x)) (OLMo-2)."""
    norm_names: tuple[str, str]
    """The layer's two RMS norm modules, in the order they apply."""
    qk_norm: str | None
    """None; ``"all_heads"``: one RMS norm over the whole q (and k) projection (OLMo-2); ``"per_head"``: an
    RMS norm over each head's head_dim values (Qwen3)."""
    float32_scale: bool
    """True (OLMo-2): a norm multiplies its weight into the float32 normalised values before casting, and
    the rotary embedding runs in float32. False (Llama, Qwen): a norm casts first, then multiplies, and
    the rotary cos/sin are cast to the model's dtype. Equal in float32; in bfloat16 each matches its
    transformers code."""


FAMILIES: dict[str, Family] = {  # by ``config.model_type``
    "olmo2": Family(
        "OLMo-2",
        "Olmo2ForCausalLM",
        "post",
        ("post_attention_layernorm", "post_feedforward_layernorm"),
        "all_heads",
        True,
    ),
    "llama": Family("Llama", "LlamaForCausalLM", "pre", ("input_layernorm", "post_attention_layernorm"), None, False),
    "qwen2": Family("Qwen2", "Qwen2ForCausalLM", "pre", ("input_layernorm", "post_attention_layernorm"), None, False),
    "qwen3": Family(
        "Qwen3", "Qwen3ForCausalLM", "pre", ("input_layernorm", "post_attention_layernorm"), "per_head", False
    ),
}

# Rotary embeddings whose frequencies change with the sequence length; the engine computes cos/sin
# from the model's fixed ``inv_freq``.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _supported_list() -> str:
    return ", ".join(f"{f.name} ({f.model_class})" for f in FAMILIES.values())


def unsupported_reason(config: PretrainedConfig, model_class: str | None = None) -> str | None:
    """None when hf-fast runs a model of this transformers ``config``; otherwise one line that says why and
    names the fallback. Reads the config only, so it can run before the weights load."""
    model_type = getattr(config, "model_type", None)
    fallback = "use engine.name: hf (engine.name: auto picks it by itself)"
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        arch = model_class or ", ".join(getattr(config, "architectures", None) or []) or model_type
        return f"hf-fast runs {_supported_list()} models, not {arch}; {fallback}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"
    if any(t in rope_type for t in _LENGTH_DEPENDENT_ROPE):
        return (
            f"hf-fast needs a fixed rotary embedding; this {family.name} model's rope_type {rope_type!r} "
            f"changes with length; {fallback}"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return (
            f"hf-fast attends to every earlier token; this {family.name} model uses sliding-window attention; "
            f"{fallback}"
        )
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % kv:
        return f"hf-fast needs num_attention_heads ({heads}) to be a multiple of num_key_value_heads ({kv}); {fallback}"
    return None


@dataclass(frozen=True)
class Layout:
    """One model's decoder-layer layout: its family and the sizes the step needs."""

    family: Family
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.heads // self.kv_heads


class UnsupportedModelError(UserError, ValueError):
    """A model the fast engine cannot run (the message names the ``hf`` fallback)."""


def layout_of(model: torch.nn.Module) -> Layout:
    """The layout of ``model``; a one-line ``UnsupportedModelError`` (naming the supported families and the ``hf``
    fallback) for a model hf-fast cannot run."""
    config: Any = model.config  # a transformers config: its fields are read by name
    reason = unsupported_reason(config, type(model).__name__)
    if reason is None and not (hasattr(model, "lm_head") and hasattr(getattr(model, "model", None), "layers")):
        reason = (
            f"hf-fast runs causal LMs ({_supported_list()}), not {type(model).__name__}; "
            "use engine.name: hf (engine.name: auto picks it by itself)"
        )
    if reason is not None:
        raise UnsupportedModelError(reason)
    heads = config.num_attention_heads
    return Layout(
        family=FAMILIES[config.model_type],
        layers=len(model.model.layers),  # type: ignore[union-attr, arg-type]  # transformers' decoder stack
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        eps=config.rms_norm_eps,
    )


@dataclass
class LayerWeights:
    """One decoder layer's tensors, as the step reads them (the model's own parameters, no copies);
    a bias or q/k norm the layer does not have is None."""

    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    norm1: torch.Tensor
    """Before attention ("pre") or on its output ("post")."""
    norm2: torch.Tensor
    """Before the MLP ("pre") or on its output ("post")."""
    w_gate: torch.Tensor
    b_gate: torch.Tensor | None
    w_up: torch.Tensor
    b_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    """The MLP's activation function (the model's own module)."""


def layer_weights(model: torch.nn.Module, layout: Layout) -> list[LayerWeights]:
    out = []
    first, second = layout.family.norm_names
    for layer in model.model.layers:  # type: ignore[union-attr]  # transformers' decoder stack
        attn, mlp = layer.self_attn, layer.mlp
        out.append(
            LayerWeights(
                wq=attn.q_proj.weight,
                bq=attn.q_proj.bias,
                wk=attn.k_proj.weight,
                bk=attn.k_proj.bias,
                wv=attn.v_proj.weight,
                bv=attn.v_proj.bias,
                wo=attn.o_proj.weight,
                bo=attn.o_proj.bias,
                q_norm=attn.q_norm.weight if layout.family.qk_norm else None,
                k_norm=attn.k_norm.weight if layout.family.qk_norm else None,
                norm1=getattr(layer, first).weight,
                norm2=getattr(layer, second).weight,
                w_gate=mlp.gate_proj.weight,
                b_gate=mlp.gate_proj.bias,
                w_up=mlp.up_proj.weight,
                b_up=mlp.up_proj.bias,
                w_down=mlp.down_proj.weight,
                b_down=mlp.down_proj.bias,
                act=mlp.act_fn,
            )
        )
    return out
