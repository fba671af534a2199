"""Data-parallel training on torch.distributed: process groups from torchrun, each rank's share of a
rollout batch, exact loss aggregation across ranks (``GlobalBatch``), DDP and FSDP2 wrapping, full
weights gathered tensor by tensor, metrics reduced across ranks, and sharded checkpoints (DCP).

The package exports the process-group layer (``rlvr.distributed.world``), which the training step
itself uses; the wrapping (``rlvr.distributed.wrap``) and the sharded checkpoints
(``rlvr.distributed.checkpoint``) sit above the training core and are imported from their modules.
"""

from rlvr.distributed.world import (
    GlobalBatch,
    World,
    all_reduce_tensor,
    barrier,
    broadcast_from_main,
    check_prompts_divisible,
    current_world,
    gather_objects,
    init_distributed,
    launched_by_torchrun,
    local_rows,
    main_first,
    max_metrics,
    mean_metrics,
    on_main,
    rank_prompt_range,
    rank_row_range,
    reduce_metrics,
    reduce_values,
    shutdown_distributed,
    start_process_group,
    sum_metrics,
)

__all__ = [
    "GlobalBatch",
    "World",
    "all_reduce_tensor",
    "barrier",
    "broadcast_from_main",
    "check_prompts_divisible",
    "current_world",
    "gather_objects",
    "init_distributed",
    "launched_by_torchrun",
    "local_rows",
    "main_first",
    "max_metrics",
    "mean_metrics",
    "on_main",
    "rank_prompt_range",
    "rank_row_range",
    "reduce_metrics",
    "reduce_values",
    "shutdown_distributed",
    "start_process_group",
    "sum_metrics",
]
