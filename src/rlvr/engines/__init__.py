"""Rollout engines. ``make_engine(name, ...)`` builds one by name: ``hf`` (in-process), ``hf-fast`` (in-process,
static KV cache and CUDA graphs; OLMo-2 models), ``hf-worker``
(a separate process fed over torch.distributed), ``vllm`` (an OpenAI-compatible vLLM server)."""

from rlvr.engines.base import Completion, Engine, SamplingParams

ENGINES = ("hf", "hf-fast", "hf-worker", "vllm")


def make_engine(name: str, model, tokenizer, **options) -> Engine:
    """Build engine ``name`` for the trainer's ``model`` and ``tokenizer``.

    ``options`` go to the engine's constructor: ``HFEngine`` (``max_batch_size``, ...),
    ``HFWorkerEngine`` (``device``, ``dtype``, ``bucket_mb``, ``probe_tolerance``, ...) or
    ``VLLMEngine`` (``model_name``, ``port``, ``gpu``, ...). Modules load lazily, so picking ``hf``
    never imports the worker or vLLM code.
    """
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


__all__ = ["Completion", "Engine", "SamplingParams", "ENGINES", "make_engine"]
