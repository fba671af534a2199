"""Rollout engines. ``make_engine(name, ...)`` builds one by name: ``hf`` (in-process), ``hf-fast`` (in-process,
static KV cache and CUDA graphs; OLMo-2, Llama, Qwen2 and Qwen3 models), ``auto`` (``hf-fast`` when it runs
the model, else ``hf``), ``hf-worker`` (a separate process fed over torch.distributed), ``vllm`` (an
OpenAI-compatible vLLM server)."""

from rlvr.engines.base import Completion, Engine, SamplingParams

ENGINES = ("hf", "hf-fast", "auto", "hf-worker", "vllm")


def resolve_engine_name(name: str, model) -> str:
    """``name``, with ``auto`` resolved for ``model``: ``hf-fast`` when it runs the model's architecture,
    else ``hf``."""
    if name != "auto":
        return name
    from rlvr.engines.fast.families import unsupported_reason

    return "hf" if unsupported_reason(model.config) else "hf-fast"


def make_engine(name: str, model, tokenizer, **options) -> Engine:
    """Build engine ``name`` for the trainer's ``model`` and ``tokenizer``.

    ``options`` go to the engine's constructor: ``HFEngine`` (``max_batch_size``, ...),
    ``HFWorkerEngine`` (``device``, ``dtype``, ``bucket_mb``, ``probe_tolerance``, ...) or
    ``VLLMEngine`` (``model_name``, ``port``, ``gpu``, ...). Modules load lazily, so picking ``hf``
    never imports the worker or vLLM code. ``auto`` builds ``hf-fast`` or ``hf`` (``resolve_engine_name``)
    with the same ``options``.
    """
    name = resolve_engine_name(name, model)
    if name == "hf":
        from rlvr.engines.hf import HFEngine

        return HFEngine(model, tokenizer, **options)
    if name == "hf-fast":
        from rlvr.engines.fast import FastHFEngine

        return FastHFEngine(model, tokenizer, **options)
    if name == "hf-worker":
        from rlvr.engines.worker import HFWorkerEngine

        return HFWorkerEngine(model, tokenizer, **options)
    if name == "vllm":
        from rlvr.engines.vllm import VLLMEngine

        return VLLMEngine(model, tokenizer, **options)
    raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")


__all__ = ["Completion", "Engine", "SamplingParams", "ENGINES", "make_engine", "resolve_engine_name"]
