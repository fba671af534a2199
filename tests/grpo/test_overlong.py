"""DAPO's overlong handling (``rlvr.grpo.overlong``): the soft overlong punishment by hand and against
the paper's piecewise formula and verl's, and the truncated rows' mask."""

from __future__ import annotations

import pytest
import torch

from rlvr.grpo.overlong import soft_overlong_penalty, truncated_masked


def test_soft_penalty_by_hand():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 at the limit
    lengths = torch.tensor([1, 5, 6, 7, 8, 9, 10])
    torch.testing.assert_close(
        soft_overlong_penalty(lengths, 10, 4), torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    )
    torch.testing.assert_close(soft_overlong_penalty(lengths, 10, 4, penalty=0.5)[-1], torch.tensor(-0.5))
    assert torch.equal(soft_overlong_penalty(lengths, 10, 0), torch.zeros(7))  # off
    with pytest.raises(ValueError, match="must not exceed"):
        soft_overlong_penalty(lengths, 10, 11)


def test_equals_the_paper_and_verl():
    max_len, buffer, factor = 16, 5, 0.7
    lengths = torch.arange(0, max_len + 3)

    def dapo_eq13(y: int) -> float:
        """DAPO (Yu et al. 2025), equation 13, written out."""
        if y <= max_len - buffer:
            return 0.0
        if y <= max_len:
            return ((max_len - buffer) - y) / buffer
        return -1.0

    paper = torch.tensor([factor * dapo_eq13(int(y)) for y in lengths])
    ours = soft_overlong_penalty(lengths, max_len, buffer, factor)
    torch.testing.assert_close(ours, paper)
    # verl, verl/workers/reward_manager/dapo.py (overlong_buffer), written out for |y| <= L_max:
    #   expected_len = max_resp_len - overlong_buffer_len; exceed_len = valid_response_length - expected_len
    #   overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
    within = lengths <= max_len
    verl = torch.clamp(-(lengths.float() - (max_len - buffer)) / buffer * factor, max=0.0)
    torch.testing.assert_close(ours[within], verl[within])


def test_truncated_rows_lose_their_mask():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    out = truncated_masked(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[False, True, True], [False, False, False], [True, True, True]]
    assert truncated_masked(mask.long(), torch.tensor([True, False, False])).tolist() == [
        [0, 0, 0],
        [0, 1, 0],
        [1, 1, 1],
    ]
