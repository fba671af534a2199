"""Reward functions by name: the built-ins, a user's function in a worker process, and weighted sums.

``reward.fn`` names one of ``BUILTIN_REWARDS`` or a user function, ``package.module:function`` or
``path/to/file.py:function``. A user function is called as ``fn(response, ground_truth, **fields)``
(``fields``: the example's other columns) and returns a float, or a dict with ``reward`` and any
other numbers, which are logged as ``train/reward/<name>``. It runs in a worker process (see
``rlvr.task.reward_worker``) through the same line protocol as the symbolic grader: a call that takes longer
than ``reward.timeout_s`` kills the worker, scores 0 and is counted (``reward/timeouts``); the next
call starts a fresh worker; a function cut off on ``TIMEOUTS_IN_A_ROW_LIMIT`` calls in a row, or that
raises, stops the run with a message that says so.

``reward.fns`` with ``reward.weights`` sums several rewards into one; each one's reward is then
logged under its own name.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlvr.errors import UserError
from rlvr.grpo import compute_rollout_rewards
from rlvr.task import code_reward, grading
from rlvr.task.generated import reasoning_gym_tasks
from rlvr.task.remote_reward import RemoteReward
from rlvr.task.reward_worker import is_file_spec

if TYPE_CHECKING:
    import torch

BUILTIN_REWARDS: dict[str, Callable] = {
    "r1_zero": grading.r1_zero_reward_fn,
    "question_only": grading.question_only_reward_fn,
    "boxed": grading.boxed_reward_fn,
    "exact": grading.exact_reward_fn,
    "code": code_reward.code_reward_fn,
    "reasoning_gym": reasoning_gym_tasks.reasoning_gym_reward_fn,
}
# The built-ins that read the row's fields (the others take response and ground truth only).
BUILTINS_WITH_FIELDS = ("reasoning_gym",)
# Why a built-in cannot run on this machine (None: it can), asked before any model loads.
BUILTIN_PRECONDITIONS: dict[str, Callable[[], str | None]] = {
    "code": code_reward.unavailable,
    "reasoning_gym": reasoning_gym_tasks.unavailable,
}
WORKER_STARTUP_TIMEOUT_S = 120.0
"""Seconds a user reward's worker may take to import the function (its module may load a lot)."""
TIMEOUTS_IN_A_ROW_LIMIT = 8
"""A user function cut off on this many calls in a row stops the run (it would only burn time)."""
WORKER_REPLY_GRACE_S = 10.0
"""Seconds a worker may take beyond its calls' timeouts to answer a batch before it is taken as hung."""
WORKER_KINDS = ("thread", "process")
_PROTOCOL_KEYS = ("reward", "format_reward", "answer_reward")
ROW_CONTEXT = ("prompt", "messages", "conversation", "env")
"""What a user function may also take by keyword: the rendered prompt and its chat messages; under a
multi-turn environment also the whole ``conversation`` and the environment's reward fields ``env``."""


class RewardConfigError(UserError, ValueError):
    """A reward setting that cannot be used."""


class RewardFunctionError(RuntimeError):
    """A reward function that raised or returned something that is not a reward."""


def spec_problem(spec: str, key: str = "reward.fn") -> str | None:
    """Why ``spec`` cannot name a reward function, read without importing anything (None: it may)."""
    if spec in BUILTIN_REWARDS or is_url(spec):
        return None
    target, sep, name = spec.rpartition(":")
    hint = f"name a built-in ({', '.join(BUILTIN_REWARDS)}), package.module:function or path/to/file.py:function"
    if not sep or not target or not name.isidentifier():
        return f"{key} {spec!r} is not a reward function: {hint}"
    if is_file_spec(target) and not os.path.isfile(target):
        return f"{key} {spec!r}: no such file {target} (relative to {os.getcwd()}); {hint}"
    return None


def row_fields(fields: dict, prompt: str, messages: list[dict[str, str]]) -> dict:
    """The keyword arguments of a user reward function for one response: the rendered ``prompt``, its
    chat ``messages`` and the row's other columns (a column of the same name wins)."""
    return {"prompt": prompt, "messages": messages, **fields}


def is_url(spec: str) -> bool:
    """A reward server's address (``reward.url``) rather than a function."""
    return spec.startswith(("http://", "https://"))


def component_name(spec: str) -> str:
    return spec if spec in BUILTIN_REWARDS else "remote" if is_url(spec) else spec.rpartition(":")[2]


class UserRewardFunction:
    """A user's reward function, called in worker processes with a time bound per call.

    ``workers`` calls run at once: as threads (or event-loop tasks, for ``async def``) of one worker
    process with ``kind="thread"``, for rewards that wait (a web service, a model server, the
    sandbox); in that many worker processes with ``kind="process"``, for rewards that compute.
    """

    def __init__(self, spec: str, timeout_s: float, workers: int = 1, kind: str = "thread"):
        if kind not in WORKER_KINDS:
            raise RewardConfigError(f"reward.worker_kind {kind!r} is not one of {', '.join(WORKER_KINDS)}")
        if workers < 1:
            raise RewardConfigError(f"reward.workers must be >= 1, got {workers}")
        self.spec = spec
        self.timeout_s = timeout_s
        self.threads = workers if kind == "thread" else 1
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
        command = [sys.executable, "-P", worker, spec]
        self.workers = [
            grading.LineWorker(command, WORKER_STARTUP_TIMEOUT_S, quiet=False)
            for _ in range(1 if kind == "thread" else workers)
        ]
        self.pool = ThreadPoolExecutor(len(self.workers)) if len(self.workers) > 1 else None
        self.timeouts_in_a_row = 0

    def start(self, fields: Sequence[str] = ()) -> None:
        """Load the function now and check that it takes ``(response, ground_truth, **fields)`` with
        ``fields``; ``RewardConfigError`` naming the problem otherwise."""
        for worker in self.workers:
            try:
                worker.start()
                reply = worker.request({"bind": list(fields), "context": list(ROW_CONTEXT)}, WORKER_STARTUP_TIMEOUT_S)
            except (OSError, TimeoutError, ValueError) as e:
                raise RewardConfigError(f"reward function {self.spec!r}: {e}") from None
            if not reply.get("ok"):
                columns = f" and the data's other columns ({', '.join(fields)})" if fields else ""
                raise RewardConfigError(
                    f"reward function {self.spec!r} cannot be called as fn(response, ground_truth, **fields) with "
                    f"the fields{columns}: {reply.get('error')}; give it a **fields parameter"
                )

    def __call__(self, response: str, ground_truth: str, **fields: Any) -> dict:
        return self.score_batch([(response, ground_truth, fields)])[0]

    def score_batch(self, rows: Sequence[tuple[str, str, dict]]) -> list[dict]:
        """The reward dict of each ``(response, ground_truth, fields)``; a call cut off scores 0 with
        ``timed_out`` 1."""
        shares = [list(range(i, len(rows), len(self.workers))) for i in range(len(self.workers))]
        jobs = [(worker, [rows[i] for i in share]) for worker, share in zip(self.workers, shares) if share]
        if self.pool is None:
            replies = [self._request(*job) for job in jobs]
        else:
            replies = list(self.pool.map(lambda job: self._request(*job), jobs))
        values: list[Any] = [None] * len(rows)
        cut_off = [False] * len(rows)
        for share, (share_values, share_cut_off) in zip(shares, replies):
            for i, value, cut in zip(share, share_values, share_cut_off):
                values[i], cut_off[i] = value, cut
        out = []
        for value, cut in zip(values, cut_off):
            if cut:
                self.timeouts_in_a_row += 1
                if self.timeouts_in_a_row >= TIMEOUTS_IN_A_ROW_LIMIT:
                    # Every call cut off: the function is broken, and each call would cost a full timeout.
                    raise RewardFunctionError(
                        f"reward function {self.spec!r} took longer than reward.timeout_s={self.timeout_s} s on "
                        f"{self.timeouts_in_a_row} calls in a row; make it faster or raise reward.timeout_s"
                    )
                out.append({"reward": 0.0, "timed_out": 1.0})
            else:
                self.timeouts_in_a_row = 0
                out.append(as_reward_dict(value, self.spec))
        return out

    def _request(self, worker: grading.LineWorker, rows: list[tuple[str, str, dict]]) -> tuple[list, list[bool]]:
        """One worker's (values, cut off) for ``rows``; the worker is replaced when a call may still run."""
        batch = [{"response": r, "ground_truth": g, "fields": f} for r, g, f in rows]
        payload = {"batch": batch, "context": ROW_CONTEXT, "threads": self.threads, "timeout_s": self.timeout_s}
        # Each wave of calls may take the whole timeout; past that the worker itself is stuck.
        bound = self.timeout_s * math.ceil(len(rows) / self.threads) + WORKER_REPLY_GRACE_S
        try:
            reply = worker.request(payload, bound)
        except TimeoutError:
            return [None] * len(rows), [True] * len(rows)
        except grading.WorkerStartError as e:
            raise RewardFunctionError(f"reward function {self.spec!r} could not be loaded: {e}") from None
        except (OSError, ValueError) as e:
            raise RewardFunctionError(f"reward function {self.spec!r} ended its worker process ({e})") from None
        if not reply.get("ok"):
            raise RewardFunctionError(f"reward function {self.spec!r} raised {reply.get('error')}")
        if reply.get("stuck"):
            worker.close()  # a thread still runs a cut-off call there; the next request starts afresh
        cut_off = set(reply["timed_out"])
        return reply["values"], [i in cut_off for i in range(len(rows))]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False)


def as_reward_dict(value: Any, where: str) -> dict:
    """A reward function's result as a dict of floats with ``reward``."""
    if isinstance(value, (bool, int, float)):
        return {"reward": float(value)}
    if isinstance(value, dict) and "reward" in value:
        out = {}
        for k, v in value.items():
            if isinstance(v, (bool, int, float)):
                out[str(k)] = float(v)
            elif k in _PROTOCOL_KEYS:
                raise RewardFunctionError(f"reward function {where!r} returned {k}={v!r}; it must be a number")
        return out
    raise RewardFunctionError(
        f"reward function {where!r} returned {type(value).__name__} {str(value)[:80]!r}; "
        "return a float or a dict with a 'reward' number"
    )


class Reward:
    """The run's reward: one function or a weighted sum, called as ``(response, ground_truth, **fields)``
    or on a whole batch (``score_batch``).

    Returns ``reward`` (the weighted sum), ``format_reward`` (the lowest of those the functions report;
    1 when none does), ``answer_reward`` (the one function's, else the sum), ``timed_out`` (1 when a
    user function was cut off) and the extra numbers to log: each function's other fields, and with
    several functions each one's reward under its name (its other fields as ``name/field``).
    ``workers`` rows are scored at once by each function (see ``UserRewardFunction``, ``RemoteReward``;
    built-ins on threads).
    """

    def __init__(
        self,
        specs: Sequence[str],
        weights: Sequence[float] | None = None,
        timeout_s: float = 10.0,
        workers: int = 1,
        worker_kind: str = "thread",
        code_isolation: bool = True,
    ):
        weights = list(weights) if weights else [1.0] * len(specs)
        # Settings of the built-ins that have some, passed to the function and to its precondition.
        builtin_options = {"code": {"require_isolation": code_isolation}}
        if len(weights) != len(specs):
            raise RewardConfigError(
                f"reward.weights has {len(weights)} numbers for {len(specs)} reward.fns; give one per function"
            )
        self.components: list[tuple[str, Any, float]] = []
        names: set[str] = set()
        for spec, weight in zip(specs, weights):
            problem = spec_problem(spec)
            if problem:
                raise RewardConfigError(problem)
            name = component_name(spec)
            while name in names:
                name += "_"
            names.add(name)
            fn: Any
            if spec in builtin_options:
                fn = functools.partial(BUILTIN_REWARDS[spec], **builtin_options[spec])
            elif spec in BUILTIN_REWARDS:
                fn = BUILTIN_REWARDS[spec]
            elif is_url(spec):
                fn = RemoteReward(spec, timeout_s, workers)
            else:
                fn = UserRewardFunction(spec, timeout_s, workers, worker_kind)
            self.components.append((name, fn, float(weight)))
        self.specs = list(specs)
        self.preconditions = [
            functools.partial(BUILTIN_PRECONDITIONS[spec], **builtin_options.get(spec, {}))
            for spec in specs
            if spec in BUILTIN_PRECONDITIONS
        ]
        self.pool = ThreadPoolExecutor(workers) if workers > 1 else None

    @property
    def has_user_functions(self) -> bool:
        return any(isinstance(fn, UserRewardFunction) for _, fn, _ in self.components)

    def start(self, fields: Sequence[str] = ()) -> None:
        """Check that the built-ins can run here, start the user functions' workers and check their
        signatures (before any model loads)."""
        for spec, check in zip([s for s in self.specs if s in BUILTIN_PRECONDITIONS], self.preconditions):
            problem = check()
            if problem:
                raise RewardConfigError(f"reward {spec} cannot run on this machine: {problem}")
        for _, fn, _ in self.components:
            if isinstance(fn, UserRewardFunction):
                fn.start(fields)

    def close(self) -> None:
        for _, fn, _ in self.components:
            if isinstance(fn, (UserRewardFunction, RemoteReward)):
                fn.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def __call__(self, response: str, ground_truth: str, **fields: Any) -> dict:
        return self.score_batch([response], [ground_truth], [fields])[0]

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str], fields: Sequence[dict]) -> list[dict]:
        """The reward dict of each response (see the class docstring)."""
        rows = list(zip(responses, ground_truths, fields))
        results = []
        for spec, (_, fn, _) in zip(self.specs, self.components):
            if isinstance(fn, UserRewardFunction):
                results.append(fn.score_batch(rows))
            elif isinstance(fn, RemoteReward):
                results.append([as_reward_dict(v, fn.url) for v in fn.score_batch(rows)])
            else:
                with_fields = spec in BUILTINS_WITH_FIELDS

                def call(row: tuple[str, str, dict], fn: Callable = fn, with_fields: bool = with_fields) -> dict:
                    return fn(row[0], row[1], **row[2]) if with_fields else fn(row[0], row[1])

                results.append(list(self.pool.map(call, rows)) if self.pool is not None else [call(r) for r in rows])
        return [self._combine([result[i] for result in results]) for i in range(len(rows))]

    def _combine(self, results: list[dict]) -> dict:
        """One row's reward dict from each function's."""
        several = len(self.components) > 1
        total, formats, out = 0.0, [], {"timed_out": 0.0}
        for (name, _, weight), r in zip(self.components, results):
            out["timed_out"] = max(out["timed_out"], r.get("timed_out", 0.0))
            total += weight * r["reward"]
            if "format_reward" in r:
                formats.append(r["format_reward"])
            if several:
                out[name] = r["reward"]
            for key, value in r.items():
                if key not in _PROTOCOL_KEYS and key != "timed_out":
                    out[f"{name}/{key}" if several else key] = value
        # The one function's answer reward (its reward if it reports none), else the sum.
        answer = results[0].get("answer_reward", results[0]["reward"]) if len(results) == 1 else total
        out.update(reward=total, format_reward=min(formats) if formats else 1.0, answer_reward=answer)
        return out


def build_reward(
    fn: str | None,
    fns: Sequence[str] = (),
    weights: Sequence[float] = (),
    timeout_s: float = 10.0,
    default: str = "r1_zero",
    url: str | None = None,
    workers: int = 1,
    worker_kind: str = "thread",
    code_isolation: bool = True,
) -> Reward:
    """The ``Reward`` of the settings (``default``: the prompt's own, when none of fn, fns and url is set)."""
    problem = reward_settings_problem(fn, fns, url, workers, worker_kind)
    if problem:
        raise RewardConfigError(problem)
    if weights and not fns:
        raise RewardConfigError("reward.weights go with reward.fns; with one reward.fn leave them out")
    specs = list(fns) if fns else [fn or url or default]
    return Reward(specs, weights, timeout_s, workers, worker_kind, code_isolation)


def reward_settings_problem(
    fn: str | None, fns: Sequence[str], url: str | None, workers: int, worker_kind: str
) -> str | None:
    """Why the reward settings cannot work together (None: they can)."""
    if fn is not None and fns:
        return "set reward.fn (one function) or reward.fns (several, with reward.weights), not both"
    if url is not None and (fn is not None or fns):
        return "set reward.url (a reward server) or reward.fn / reward.fns, not both"
    if url is not None and not is_url(url):
        return f"reward.url {url!r} is not an http:// or https:// address"
    if workers < 1:
        return f"reward.workers must be >= 1, got {workers}"
    if worker_kind not in WORKER_KINDS:
        return f"reward.worker_kind must be one of {', '.join(WORKER_KINDS)}, got {worker_kind!r}"
    return None


def score_responses(
    reward_fn: Callable[[str, str], dict],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    fields: Sequence[dict] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Score every response like ``compute_rollout_rewards``; a ``Reward`` also gets each example's
    ``fields`` and adds ``logged`` to the metadata: the mean of each extra number as
    ``reward/<name>`` and the count of cut-off calls as ``reward/timeouts``."""
    import torch

    if not isinstance(reward_fn, Reward):
        return compute_rollout_rewards(reward_fn, responses, ground_truths)
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths; pass one per response")
    fields = fields if fields is not None else [{}] * len(responses)
    scores = reward_fn.score_batch(responses, ground_truths, fields)
    rewards_t = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    fmt = torch.tensor([s["format_reward"] for s in scores], dtype=torch.float32)
    ans = torch.tensor([s["answer_reward"] for s in scores], dtype=torch.float32)
    sums: dict[str, list[float]] = {}
    for s in scores:
        for k, v in s.items():
            if k not in _PROTOCOL_KEYS and k != "timed_out":
                sums.setdefault(k, []).append(v)
    n = len(scores)
    logged = {f"reward/{k}": sum(v) / len(v) for k, v in sums.items() if all(math.isfinite(x) for x in v)}
    if reward_fn.has_user_functions:
        logged["reward/timeouts"] = float(sum(s["timed_out"] for s in scores))
    meta = {
        "reward_mean": rewards_t.mean().item() if n else 0.0,
        "format_reward_mean": fmt.mean().item() if n else 0.0,
        "answer_reward_mean": ans.mean().item() if n else 0.0,
        "format_rewards": fmt,
        "scores": scores,
        "logged": logged,
    }
    return rewards_t, meta
