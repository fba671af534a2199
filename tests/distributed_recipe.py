"""A miniature of the data-parallel rollout step, run by ``tests/distributed/test_distributed_recipe.py`` in one
process and under ``torchrun``: each rank takes its prompts of every rollout batch, grades and
normalises its own groups, scores old log-probs with the (wrapped) policy, and trains on its rows of
shuffled global minibatches for two epochs with ``GlobalBatch``. Rewards are a fixed function of
(example, sample), so no engine is needed.

Run under torchrun as ``python distributed_recipe.py OUT_DIR``: writes each variant's final weights
(rank 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_helpers import exit_now, tiny_causal_lm  # noqa: E402

N_EXAMPLES, P, G, SEED = 12, 4, 2, 5
TRAIN_BATCH, STEPS, EPOCHS = 4, 2, 2
VARIANTS = ("ddp", "fsdp", "ddp-lora", "fsdp-lora")


def _ids(seed: int, low: int, high: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 64, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()


def _policy(lora: bool):
    from rlvr.config import LoraConfig
    from rlvr.training.lora import apply_lora

    model = tiny_causal_lm(seed=0)
    if lora:
        torch.manual_seed(1)  # the same adapter initialisation in every process
        model = apply_lora(model, LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj")))
        with torch.no_grad():  # start with B away from zero, so A gets a gradient at the first step too
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def train(variant: str | None, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
    """Full weights (plain names, LoRA merged) after ``STEPS`` rollout steps; ``variant`` None is the
    one-process run, else a strategy with or without LoRA over the started process group."""
    from rlvr.distributed import GlobalBatch, local_rows, rank_prompt_range, rank_row_range
    from rlvr.distributed.wrap import iter_full_weights, wrap_model
    from rlvr.grpo import compute_group_normalized_rewards
    from rlvr.task.data_order import batch_indices
    from rlvr.training.logprobs import compute_log_probs_batched
    from rlvr.training.tokenize import tokenize_from_ids
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    model = _policy(lora=variant is not None and variant.endswith("lora"))
    if variant in (None, "reference-lora"):
        rank, world_size = 0, 1
    else:
        model = wrap_model(model, variant.split("-")[0])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    held = rank_row_range(P, G, rank, world_size)
    share = rank_prompt_range(P, rank, world_size)
    for step in range(STEPS):
        examples = batch_indices(N_EXAMPLES, P, step, SEED)[share.start : share.stop]
        prompts = [_ids(1000 + e, 3, 6) for e in examples]
        responses = [_ids(10_000 * step + 10 * e + s, 2, 7) for e in examples for s in range(G)]
        rewards = torch.tensor([float((e + s + step) % 3 == 0) for e in examples for s in range(G)])
        advantages, _ = compute_group_normalized_rewards(rewards, G, "mean", 1e-6, "std")
        batch = tokenize_from_ids([prompts[i // G] for i in range(len(responses))], responses, 0)
        old = compute_log_probs_batched(model, batch["input_ids"], batch["labels"], 2)
        for epoch in range(EPOCHS):
            order = torch.randperm(P * G, generator=torch.Generator().manual_seed(100 * step + epoch)).tolist()
            for start in range(0, P * G, TRAIN_BATCH):
                mine = torch.tensor(local_rows(order[start : start + TRAIN_BATCH], held), dtype=torch.long)
                policy_gradient_update(
                    model,
                    optimizer,
                    StepBatch(
                        batch["input_ids"][mine],
                        batch["labels"][mine],
                        batch["response_mask"][mine],
                        advantages[mine],
                        old[mine],
                    ),
                    UpdateSpec(2, 1.0, reweighting="grpo", cliprange=0.2),
                    global_batch=None
                    if world_size == 1 and variant in (None, "reference-lora")
                    else GlobalBatch.of(len(mine)),
                )
    return {name: t.detach().cpu().clone() for name, t in iter_full_weights(model)}


def main(out_dir: str) -> None:
    import rlvr.training.logprobs
    from rlvr.distributed import barrier, init_distributed, shutdown_distributed

    def refuse_full_logits(*args, **kwargs):
        raise AssertionError("a wrapped model took the full-logits path instead of the fused head")

    rlvr.training.logprobs._stats_from_logits = refuse_full_logits  # DDP and FSDP2, with LoRA too, keep the fused head
    torch.set_num_threads(1)
    world = init_distributed("cpu")
    assert world.distributed and world.backend == "gloo", world
    results = {variant: train(variant, world.rank, world.world_size) for variant in VARIANTS}
    if world.is_main:
        torch.save(results, Path(out_dir) / "weights.pt")
    barrier()  # no rank tears the group down while another still uses it
    shutdown_distributed()
    exit_now()


if __name__ == "__main__":
    main(sys.argv[1])
