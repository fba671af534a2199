"""What a command asks of the machine, checked before anything starts: the CUDA devices it names exist
here, and the programs it runs are installed. Each problem is one line that names the fix."""

from __future__ import annotations

import importlib.util
import shutil

import torch

from rlvr.config import ConfigError, TrainConfig
from rlvr.errors import UserError

SEPARATE_DEVICE_ENGINES = ("hf-worker", "vllm")
"""Engines that run on ``engine.device`` (the others run beside the policy, on ``policy_device``)."""
TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""``log.<flag>`` -> the package it needs (installed by the extra of the same name)."""


def cuda_device_problem(flag: str, device: str, n_gpu: int) -> str | None:
    """Why ``device`` (the value of ``flag``) cannot be used on a machine with ``n_gpu`` visible GPUs, or None."""
    if not device.startswith("cuda"):
        return None
    if n_gpu == 0:
        build = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible"
        return f"{flag} {device} but this machine has no CUDA device ({build}); set {flag} cpu, or auto"
    index = torch.device(device).index or 0
    if index >= n_gpu:
        return f"{flag} {device} but only cuda:0..cuda:{n_gpu - 1} are visible; set {flag} auto or a visible GPU"
    return None


def usable_device(device: str, flag: str = "--device") -> str:
    """``device`` with ``auto`` resolved (``cuda`` when a GPU is visible, else ``cpu``); a ``UserError`` for a
    CUDA device this machine lacks (``flag`` names the option in the message)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    problem = cuda_device_problem(flag, device, torch.cuda.device_count())
    if problem:
        raise UserError(problem)
    return device


def check_machine(config: TrainConfig, n_gpu: int | None = None) -> None:
    """``ConfigError`` naming every problem of ``config`` (resolved) on this machine (``n_gpu`` visible GPUs:
    default, torch's count)."""
    n_gpu = torch.cuda.device_count() if n_gpu is None else n_gpu
    engine = config.engine
    problems = [cuda_device_problem("policy_device", config.policy_device, n_gpu)]
    if engine.name in SEPARATE_DEVICE_ENGINES:
        problems.append(cuda_device_problem("engine.device", engine.device, n_gpu))
    if engine.name == "vllm" and engine.vllm.base_url is None and shutil.which("vllm") is None:
        problems.append(
            "engine.name vllm starts `vllm serve`, which is not installed: pip install 'rlvr[vllm]' on a CUDA "
            "machine, give a running server's engine.vllm.base_url, or use engine.name auto"
        )
    for flag, package in TRACKERS.items():
        if getattr(config.log, flag) and importlib.util.find_spec(package) is None:
            problems.append(
                f"log.{flag} is on but {package} is not installed: pip install 'rlvr[{flag}]', or turn it off"
            )
    found = [p for p in problems if p]
    if found:
        raise ConfigError("; ".join(found))


def resolve_device(device: str, flag: str = "--device") -> torch.device:
    """``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...) as a torch device that exists here, or a
    one-line error that names ``flag``."""
    return torch.device(usable_device(device, flag))
