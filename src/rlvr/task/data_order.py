"""Seeds and data order: every run's randomness derives from ``(seed, parts)``, and the examples of a
rollout step are a pure function of the seed and the step (one seeded permutation of the data per
epoch), so a resumed run and every rank see the one-process order."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *parts: object) -> int:
    """A 62-bit seed that depends only on ``seed`` and ``parts`` (stable across processes and runs)."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
    return torch.randperm(n, generator=g).tolist()


def batch_indices(n_examples: int, n_prompts: int, step: int, seed: int) -> list[int]:
    """Example indices of 0-based rollout step ``step``: positions ``step*n .. step*n+n-1`` of the
    stream made by concatenating one seeded permutation of the data per epoch."""
    perms: dict[int, list[int]] = {}
    out = []
    for pos in range(step * n_prompts, (step + 1) * n_prompts):
        epoch, i = divmod(pos, n_examples)
        if epoch not in perms:
            perms[epoch] = epoch_permutation(n_examples, seed, epoch)
        out.append(perms[epoch][i])
    return out
