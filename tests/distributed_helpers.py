"""Helpers for the multi-process tests: a gloo group of spawned CPU processes and a tiny model built
from a config (no tokenizer, no downloads)."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enter(rank: int, world_size: int, port: int, device: str, fn, args):
    # torchrun's variables, so the test goes through rlvr.distributed.init_distributed as a launch would.
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from rlvr.distributed import barrier, init_distributed, shutdown_distributed

    world = init_distributed(device)
    try:
        fn(world, *args)
        barrier()  # no rank tears the group down while another still uses it
    finally:
        shutdown_distributed()
    exit_now()


def exit_now() -> None:
    """End a finished rank without running interpreter and C++ teardown: gloo's worker threads can
    still be alive then, and destroying them aborts the process (SIGABRT, "terminate called without
    an active exception") after its work succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, *args, world_size: int = 2, device: str = "cpu") -> None:
    """``fn(world, *args)`` in ``world_size`` spawned processes joined in one process group (gloo on
    the CPU, NCCL with ``device="cuda"``); a failure in any of them fails the caller."""
    mp.spawn(_enter, args=(world_size, free_port(), device, fn, args), nprocs=world_size, join=True)


def tiny_config(vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2):
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )


def tiny_causal_lm(seed: int = 0, **kwargs):
    from rlvr.modeling import build_model

    model = build_model(tiny_config(**kwargs), seed=seed)
    model.train()
    return model
