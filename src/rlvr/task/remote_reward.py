"""A reward served over HTTP (``reward.url``): the rows are POSTed as JSON, the rewards come back.

Request, ``POST <url>`` with ``Content-Type: application/json``::

    {"rows": [{"response": ..., "ground_truth": ..., "prompt": ..., "messages": [...], <the row's columns>}, ...]}

Reply, status 200::

    {"rewards": [1.0, {"reward": 0.5, "style": 0.8}, ...]}     # one per row, in order

A reward is a number or a dict with ``reward`` and other numbers to log, as a reward function returns.
With ``workers`` > 1 the rows go in that many requests at once. A request that fails (no connection,
no answer within ``timeout_s``, a status of 500 or more) is tried again, ``RETRIES`` times in all with
a pause that doubles; then the step stops with ``RewardServerError``: training never goes on without
the rewards. A reply that is not as above stops it at once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlvr.errors import TrainingError

RETRIES = 3
FIRST_PAUSE_S = 0.5


class RewardServerError(TrainingError):
    """The reward server did not give a reward for every row."""


class RemoteReward:
    """``score_batch(rows)``: each row's reward from the server at ``url``."""

    def __init__(self, url: str, timeout_s: float, workers: int = 1, retries: int = RETRIES):
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self.workers = workers

    def score_batch(self, rows: Sequence[tuple[str, str, dict]]) -> list[Any]:
        """The server's reward of each ``(response, ground_truth, fields)``, in order."""
        payload = [{"response": r, "ground_truth": g, **f} for r, g, f in rows]
        size = -(-len(payload) // self.workers) or 1
        chunks = [payload[i : i + size] for i in range(0, len(payload), size)]
        if self.pool is None:
            answers = [self._post(chunk) for chunk in chunks]
        else:
            answers = list(self.pool.map(self._post, chunks))
        return [reward for answer in answers for reward in answer]

    def _post(self, rows: list[dict]) -> list[Any]:
        body = json.dumps({"rows": rows}, default=str).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        pause, problem = FIRST_PAUSE_S, ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(pause)
                pause *= 2
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    reply = response.read()
            except urllib.error.HTTPError as e:
                problem = f"status {e.code} {e.reason}"
                if e.code < 500:
                    break  # the server refuses this request: asking again gives the same answer
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                problem = str(getattr(e, "reason", e))
                continue
            return self._rewards(reply, len(rows))
        raise RewardServerError(
            f"the reward server {self.url} gave no rewards ({problem}) after {attempt + 1} tries; start it, or "
            "check reward.url (the step's rewards are missing, so training stops here)"
        )

    def _rewards(self, reply: bytes, n: int) -> list[Any]:
        try:
            rewards = json.loads(reply)["rewards"]
        except (ValueError, KeyError, TypeError):
            rewards = None
        if not isinstance(rewards, list) or len(rewards) != n:
            raise RewardServerError(
                f"the reward server {self.url} answered {reply[:80]!r}; it must answer "
                f'{{"rewards": [...]}} with one reward per row ({n})'
            )
        return rewards

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
