"""Rollout engines. ``make_engine(name, ...)`` builds one by name: ``hf`` (in-process), ``hf-worker``
(a separate process fed over torch.distributed), ``vllm`` (an OpenAI-compatible vLLM server)."""

from rlvr.engines.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
