"""rlvr: reinforcement learning with verifiable rewards for language models.

The course-standard GRPO functions and the two reward functions are importable from here::

    from rlvr import (tokenize_prompt_and_output, get_response_log_probs, compute_rollout_rewards,
                      compute_group_normalized_rewards, compute_policy_gradient_loss,
                      aggregate_loss_across_microbatch, grpo_train_step,
                      r1_zero_reward_fn, question_only_reward_fn)

and so are those of instruction tuning, DPO and the assistant evaluations::

    from rlvr import (get_packed_sft_dataset, iterate_batches, compute_per_instance_dpo_loss,
                      parse_mmlu_response, parse_gsm8k_response)
"""

from typing import Any

from rlvr.dpo import compute_per_instance_dpo_loss
from rlvr.grpo import (
    PRESETS,
    aggregate_loss_across_microbatch,
    compute_group_normalized_rewards,
    compute_policy_gradient_loss,
    compute_rollout_rewards,
    get_response_log_probs,
    grpo_train_step,
    tokenize_prompt_and_output,
)
from rlvr.instruct import get_packed_sft_dataset, iterate_batches
from rlvr.suites.parsing import parse_gsm8k_response, parse_mmlu_response

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "aggregate_loss_across_microbatch",
    "compute_group_normalized_rewards",
    "compute_policy_gradient_loss",
    "compute_rollout_rewards",
    "get_response_log_probs",
    "grpo_train_step",
    "tokenize_prompt_and_output",
    "r1_zero_reward_fn",
    "question_only_reward_fn",
    "get_packed_sft_dataset",
    "iterate_batches",
    "compute_per_instance_dpo_loss",
    "parse_mmlu_response",
    "parse_gsm8k_response",
]


def __getattr__(name: str) -> Any:
    # Rewards import lazily: grading pulls in math-verify/sympy, which the math above does not need.
    if name in ("r1_zero_reward_fn", "question_only_reward_fn"):
        from rlvr import rewards

        return getattr(rewards, name)
    raise AttributeError(f"module 'rlvr' has no attribute {name!r}")
