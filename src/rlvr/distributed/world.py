"""The process group, each rank's share of a rollout batch, and metrics reduced across ranks.

``init_distributed`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, with
``MASTER_ADDR``/``MASTER_PORT`` for the rendezvous) and starts the default process group: NCCL when
the rank has a GPU, gloo on the CPU. Without torchrun's variables it returns a one-process ``World``
and starts no group, and every helper below then works on the local values alone, so a one-process
run takes the same code path.

A rollout batch of P prompts × G samples is split by prompts: rank r takes prompts
``r·P/W .. (r+1)·P/W − 1`` of the global batch, with all their samples. A group therefore never
spans ranks (advantages are normalised within a group, so they stay rank-local and exact), and the
ranks' shares concatenated in rank order are the one-process batch of the same seed and step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from rlvr.config import ConfigError

ReduceOp = Literal["sum", "mean", "max", "min"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class World:
    """Where this process stands: its rank among ``world_size``, its device, and the backend of the
    default process group (None for a one-process run without a group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None and self.world_size > 1


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def init_distributed(device: str | None = None, timeout: timedelta = timedelta(minutes=30)) -> World:
    """Start the default process group from torchrun's environment, or describe a one-process run.

    ``device``: ``cuda`` or ``cpu`` (default: CUDA when available). Under torchrun each rank takes
    ``cuda:LOCAL_RANK`` with NCCL for GPU tensors and gloo for CPU ones (``cpu:gloo,cuda:nccl``: FSDP2's
    CPU offload keeps sharded parameters and gradients on the CPU, and clipping, gathering and
    checkpointing them are collectives over CPU tensors); without a GPU gloo alone. An already
    started default group is reused.
    """
    use_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not launched_by_torchrun():
        dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return World(device=dev)
    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        # device_id binds the NCCL communicator to this rank's GPU at once (no lazy guess later).
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timeout, device_id=dev if use_cuda else None
        )
    return World(rank, world_size, local_rank, dev, dist.get_backend())


def start_process_group(device: str | None = None) -> World:
    """``init_distributed`` for torchrun's processes, or, without torchrun, a process group of one
    (a free local port for the rendezvous): a one-process run with FSDP2 goes through the same code."""
    if launched_by_torchrun() or dist.is_initialized():
        return init_distributed(device)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        return init_distributed(device)
    finally:  # the process was not started by torchrun, and must not look as if it had been
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def current_world() -> World:
    """The ``World`` of an already started default group (or the one-process world)."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    backend = dist.get_backend()
    if "nccl" in backend:
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), dev, backend)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Each rank's share of a rollout batch
# ---------------------------------------------------------------------------------------------


def check_prompts_divisible(n_prompts: int, world_size: int) -> None:
    """``ConfigError`` unless the prompts of a rollout batch split evenly over the ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n_prompts % world_size:
        lower = n_prompts - n_prompts % world_size
        raise ConfigError(
            f"rollout.n_prompts_per_rollout_batch={n_prompts} does not split over {world_size} ranks: each rank "
            f"takes whole prompt groups, so use a multiple of {world_size} (e.g. {lower or world_size} or "
            f"{lower + world_size}) or another number of processes"
        )


def rank_prompt_range(n_prompts: int, rank: int, world_size: int) -> range:
    """Positions (within the global rollout batch) of the prompts rank ``rank`` samples and trains on."""
    check_prompts_divisible(n_prompts, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    per_rank = n_prompts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def rank_row_range(n_prompts: int, group_size: int, rank: int, world_size: int) -> range:
    """Rows (prompt-major: row = prompt · G + sample) of the global rollout batch that rank ``rank`` holds."""
    prompts = rank_prompt_range(n_prompts, rank, world_size)
    return range(prompts.start * group_size, prompts.stop * group_size)


def local_rows(global_rows: Sequence[int], rows_held: range) -> list[int]:
    """The rows of a global minibatch that this rank holds, as indices into its own share (its row
    ``rows_held.start`` is local row 0), in the minibatch's order."""
    return [r - rows_held.start for r in global_rows if r in rows_held]


def _as_slice(r: range) -> slice:
    return slice(r.start, r.stop)


# ---------------------------------------------------------------------------------------------
# Reductions, and output written by the main rank alone
# ---------------------------------------------------------------------------------------------

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else torch.device("cpu")


def all_reduce_tensor(
    tensor: torch.Tensor, op: ReduceOp = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``tensor`` reduced over the ranks (a new tensor on ``tensor``'s device; itself when alone)."""
    if not _active():
        return tensor
    out = tensor.detach().to(_collective_device(), copy=True)
    dist.all_reduce(out, op=_OPS[op], group=group)
    if op == "mean":
        out /= dist.get_world_size(group)
    return out.to(tensor.device)


def reduce_values(values: Sequence[float], op: ReduceOp = "sum", group: dist.ProcessGroup | None = None) -> list[float]:
    """Python numbers reduced over the ranks in one collective (float64)."""
    if not _active() or not values:
        return [float(v) for v in values]
    return all_reduce_tensor(torch.tensor([float(v) for v in values], dtype=torch.float64), op, group).tolist()


def reduce_metrics(
    metrics: Mapping[str, float], op: ReduceOp = "mean", group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Numeric metrics reduced over the ranks, keys in sorted order so every rank sends the same
    vector; every rank must pass the same keys."""
    keys = sorted(metrics)
    return dict(zip(keys, reduce_values([metrics[k] for k in keys], op, group)))


def sum_metrics(metrics: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    return reduce_metrics(metrics, "sum", group)


def mean_metrics(metrics: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    return reduce_metrics(metrics, "mean", group)


def max_metrics(metrics: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    return reduce_metrics(metrics, "max", group)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` when alone."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable; ``obj`` itself when alone)."""
    return gather_objects(obj)[0]


def barrier() -> None:
    if _active():
        dist.barrier()


def on_main(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
    """Run ``fn`` on rank 0 only (logging, rollout dumps, files); the others get None. Raises on the
    other ranks too when it failed on rank 0, so no rank waits forever in a later collective."""
    world = current_world()
    result, error = None, None
    if world.is_main:
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # re-raised below, after the others have heard of it
            error = e
    failed = reduce_values([error is not None], "max")[0] if world.distributed else float(error is not None)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on rank 0")
    return result


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. writes a file), the other ranks after it has finished."""
    world = current_world()
    if not world.is_main:
        barrier()
    yield
    if world.is_main:
        barrier()


# ---------------------------------------------------------------------------------------------
# The global batch of one optimizer step
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalBatch:
    """What a rank's ``policy_gradient_update`` needs to know about the batch spread over all ranks.

    ``n_sequences``: sequences of the whole (all-rank) batch of this optimizer step, the
    denominator of ``sequence`` normalisation. ``world_size``: the ranks whose gradients the
    data-parallel wrapper averages (DDP and FSDP2 both divide the summed gradient by it), so each
    rank's loss is scaled by it and the average becomes the sum of the ranks' numerators over the
    global denominator: the one-process gradient of the same batch.
    """

    n_sequences: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.n_sequences < 0 or self.world_size < 1:
            raise ValueError(f"bad GlobalBatch(n_sequences={self.n_sequences}, world_size={self.world_size})")

    @classmethod
    def of(cls, local_n_sequences: int, group: dist.ProcessGroup | None = None) -> GlobalBatch:
        """The global batch made of every rank's ``local_n_sequences`` (one collective)."""
        total = reduce_values([local_n_sequences], "sum", group)[0]
        world_size = dist.get_world_size(group) if _active() else 1
        return cls(int(total), world_size, group)
