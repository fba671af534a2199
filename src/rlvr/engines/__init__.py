"""Rollout engines, in one table: ``ENGINES`` maps each name to its class (imported on first use) and to
how the ``engine`` section of a config becomes the class's constructor options.

``hf`` (in-process), ``hf-fast`` (in-process, static KV cache and CUDA graphs; OLMo-2, Llama, Qwen2 and
Qwen3 models), ``hf-worker`` (a separate process fed over torch.distributed), ``vllm`` (an
OpenAI-compatible vLLM server); ``auto`` is ``hf-fast`` when it runs the model, else ``hf``.
``build_engine`` builds one from an ``EngineConfig`` (``rlvr train``, ``rlvr eval`` and the suites
alike); ``make_engine`` builds one from constructor options given directly. ``register_engine`` adds
an engine to the table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlvr.engines.base import Completion, Engine, SamplingParams, WorkerEngine
from rlvr.engines.fast.families import unsupported_reason
from rlvr.errors import UserError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rlvr.config import EngineConfig


class UnknownEngineError(UserError, ValueError):
    """An engine name that is not in the table."""


@dataclass(frozen=True)
class EngineEntry:
    class_path: str
    """``module:ClassName``, imported on first use so that picking ``hf`` never imports vLLM or the worker."""
    options: Callable[[EngineConfig, str | None], dict[str, Any]]
    """``options(engine_config, served_model)``: the constructor's keyword arguments."""

    def load(self) -> type:
        module, _, name = self.class_path.partition(":")
        return getattr(importlib.import_module(module), name)


def _gpu_index(device: str) -> str:
    """The CUDA device index of ``device`` as the vLLM server's CUDA_VISIBLE_DEVICES (``0`` by default)."""
    return device.split(":", 1)[1] if device.startswith("cuda:") else "0"


def _hf_options(e: EngineConfig, served_model: str | None) -> dict[str, Any]:
    return {"max_batch_size": e.max_batch_size}


def _fast_options(e: EngineConfig, served_model: str | None) -> dict[str, Any]:
    f = e.fast
    return {
        "max_batch_size": e.max_batch_size,
        "release_memory": f.release_memory,
        "attention": f.attention,
        "fuse_projections": f.fuse_projections,
        "cascade_min_rows": f.cascade_min_rows,
    }


def _worker_options(e: EngineConfig, served_model: str | None) -> dict[str, Any]:
    dtype = None if e.worker.dtype == "auto" else e.worker.dtype
    return {"device": e.device, "dtype": dtype, "max_batch_size": e.max_batch_size}


def _vllm_options(e: EngineConfig, served_model: str | None) -> dict[str, Any]:
    return {
        "served_model": served_model,
        "base_url": e.vllm.base_url,
        "port": e.vllm.port,
        "gpu": _gpu_index(e.device),
        "start_server": e.vllm.base_url is None,
    }


def _no_options(e: EngineConfig, served_model: str | None) -> dict[str, Any]:
    return {}


ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry("rlvr.engines.hf:HFEngine", _hf_options),
    "hf-fast": EngineEntry("rlvr.engines.fast:FastHFEngine", _fast_options),
    "hf-worker": EngineEntry("rlvr.engines.worker:HFWorkerEngine", _worker_options),
    "vllm": EngineEntry("rlvr.engines.vllm:VLLMEngine", _vllm_options),
}
AUTO = "auto"


def engine_names() -> tuple[str, ...]:
    """Every name an ``engine.name`` may take: the table's, and ``auto``."""
    return (*ENGINES, AUTO)


def register_engine(
    name: str, class_path: str, options: Callable[[EngineConfig, str | None], dict] = _no_options
) -> None:
    """Add engine ``name`` to the table: its class as ``module:ClassName`` and how an ``EngineConfig``
    becomes its constructor options (default: none, the class's own defaults)."""
    ENGINES[name] = EngineEntry(class_path, options)


def resolve_engine_name(name: str, model: torch.nn.Module) -> str:
    """``name``, with ``auto`` resolved for ``model``: ``hf-fast`` when it runs the model's architecture,
    else ``hf``."""
    if name != AUTO:
        return name

    return "hf" if unsupported_reason(model.config) else "hf-fast"  # type: ignore[arg-type]  # a transformers config


def engine_entry(name: str) -> EngineEntry:
    """The table's entry for ``name`` (``auto`` already resolved); ``UnknownEngineError`` names the choices."""
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngineError(f"unknown engine {name!r}: choose one of {', '.join(engine_names())}") from None


def make_engine(name: str, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, **options: Any) -> Engine:
    """Build engine ``name`` for the trainer's ``model`` and ``tokenizer`` with constructor ``options``:
    ``HFEngine`` (``max_batch_size``, ...), ``FastHFEngine`` (``attention``, ``cascade_min_rows``, ...),
    ``HFWorkerEngine`` (``device``, ``dtype``, ``bucket_mb``, ``probe_tolerance``, ...) or ``VLLMEngine``
    (``served_model``, ``port``, ``gpu``, ...). ``auto`` builds ``hf-fast`` or ``hf`` (``resolve_engine_name``)
    with the same ``options``."""
    return engine_entry(resolve_engine_name(name, model)).load()(model, tokenizer, **options)


def build_engine(
    config: EngineConfig,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    served_model: str | None = None,
    **overrides: Any,
) -> Engine:
    """Build ``config.name`` with the options its section of ``config`` gives (``overrides`` win);
    ``served_model`` is the hub id or directory a server engine loads."""
    name = resolve_engine_name(config.name, model)
    entry = engine_entry(name)
    return entry.load()(model, tokenizer, **{**entry.options(config, served_model), **overrides})


__all__ = [
    "Completion",
    "Engine",
    "SamplingParams",
    "WorkerEngine",
    "ENGINES",
    "EngineEntry",
    "UnknownEngineError",
    "build_engine",
    "engine_entry",
    "engine_names",
    "make_engine",
    "register_engine",
    "resolve_engine_name",
]
