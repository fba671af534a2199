"""Data-parallel training on torch.distributed: process groups from torchrun, each rank's share of a
rollout batch, exact loss aggregation across ranks (``GlobalBatch``), DDP and FSDP2 wrapping, full
weights gathered tensor by tensor, metrics reduced across ranks, and sharded checkpoints (DCP)."""

from rlvr.distributed.checkpoint import export_hf, load_sharded, save_sharded
from rlvr.distributed.world import (
    GlobalBatch,
    World,
    all_reduce_tensor,
    barrier,
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
    rank_batch_indices,
    rank_prompt_range,
    rank_row_range,
    reduce_metrics,
    reduce_values,
    shutdown_distributed,
    sum_metrics,
)
from rlvr.distributed.wrap import (
    copy_full_weights,
    decoder_layers,
    full_state_dict_on_main,
    iter_full_weights,
    unwrap_model,
    wrap_model,
)

__all__ = [
    "GlobalBatch", "World", "all_reduce_tensor", "barrier", "check_prompts_divisible", "current_world",
    "copy_full_weights", "decoder_layers", "export_hf", "full_state_dict_on_main", "gather_objects", "init_distributed",
    "iter_full_weights", "launched_by_torchrun", "load_sharded", "local_rows", "main_first", "max_metrics",
    "mean_metrics", "on_main", "rank_batch_indices", "rank_prompt_range", "rank_row_range", "reduce_metrics",
    "reduce_values", "save_sharded", "shutdown_distributed", "sum_metrics", "unwrap_model", "wrap_model",
]
