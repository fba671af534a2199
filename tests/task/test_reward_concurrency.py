"""Rewards at scale: ``reward.workers`` calls at once (threads or processes), batched and ``async def``
functions, per-call timeouts inside a batch, and ``reward.url`` against a real HTTP server on
127.0.0.1 (retries, timeout, a server that is down, a wrong answer). Concurrency is shown by
barriers that only open when that many calls run at once, not by timings."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlvr.task import remote_reward
from rlvr.task.remote_reward import RemoteReward, RewardServerError
from rlvr.task.rewards import Reward, RewardConfigError, build_reward, row_fields, score_responses

CONCURRENT_REWARDS = textwrap.dedent("""
    import asyncio, os, threading, time

    BARRIER = threading.Barrier(4, timeout=20)

    def four_at_once(response, ground_truth, **fields):
        BARRIER.wait()  # breaks (and raises) unless four calls run at the same time
        return 1.0

    def which_process(response, ground_truth, **fields):
        time.sleep(0.2)
        return {"reward": 1.0, "pid": os.getpid()}

    def records_process(response, ground_truth, **fields):
        with open("scoring_processes.txt", "a") as f:
            f.write(f"{os.getpid()}\\n")
        return 1.0

    ARRIVED = 0

    async def four_tasks(response, ground_truth, **fields):
        global ARRIVED
        ARRIVED += 1
        while ARRIVED < 4:
            await asyncio.sleep(0.01)
        return 1.0

    def batched(rows):
        return [{"reward": float(r["response"] == r["ground_truth"]), "batch": len(rows), "has_prompt": float("prompt" in r)}
                for r in rows]

    def batched_short(rows):
        return [1.0]

    def hangs_on_hang(response, ground_truth, **fields):
        if response == "hang":
            time.sleep(60)
        return 1.0

    async def async_hangs_on_hang(response, ground_truth, **fields):
        if response == "hang":
            await asyncio.sleep(60)
        return 1.0
""")


@pytest.fixture()
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "concurrent_rewards.py").write_text(CONCURRENT_REWARDS)
    return lambda name: f"concurrent_rewards.py:{name}"


def scored(reward: Reward, responses: list[str], ground_truths: list[str] | None = None) -> list[dict]:
    ground_truths = ground_truths or ["x"] * len(responses)
    fields = [row_fields({}, "p", [{"role": "user", "content": "p"}]) for _ in responses]
    reward.start()
    try:
        return reward.score_batch(responses, ground_truths, fields)
    finally:
        reward.close()


def test_threads_run_calls_at_once(spec):
    scores = scored(Reward([spec("four_at_once")], workers=4, worker_kind="thread"), ["a"] * 8)
    assert [s["reward"] for s in scores] == [1.0] * 8


def test_one_worker_runs_one_call_at_a_time(spec):
    # The barrier never opens for one call at a time: every call is cut off after the timeout.
    scores = scored(Reward([spec("four_at_once")], timeout_s=0.3), ["a"] * 2)
    assert [(s["reward"], s["timed_out"]) for s in scores] == [(0.0, 1.0)] * 2


def test_processes_share_the_rows(spec):
    scores = scored(Reward([spec("which_process")], workers=2, worker_kind="process"), ["a"] * 6)
    assert len({s["pid"] for s in scores}) == 2 and all(s["reward"] == 1.0 for s in scores)


def test_async_functions_run_as_tasks_at_once(spec):
    scores = scored(Reward([spec("four_tasks")], workers=4, timeout_s=20), ["a"] * 4)
    assert [s["reward"] for s in scores] == [1.0] * 4


def test_a_batched_function_gets_all_rows_in_one_call(spec):
    scores = scored(Reward([spec("batched")]), ["x", "y", "x"])
    assert [(s["reward"], s["batch"], s["has_prompt"]) for s in scores] == [(1.0, 3.0, 1.0), (0.0, 3.0, 1.0)] + [
        (1.0, 3.0, 1.0)
    ]
    with pytest.raises(Exception, match="one result per row"):
        scored(Reward([spec("batched_short")]), ["x", "y"])


@pytest.mark.parametrize("name", ["hangs_on_hang", "async_hangs_on_hang"])
def test_a_call_past_the_timeout_scores_zero_is_counted_and_the_others_count(spec, name):
    reward = Reward([spec(name)], timeout_s=0.5, workers=2)
    reward.start()
    try:
        fields = [{}] * 4
        rewards, meta = score_responses(reward, ["a", "hang", "b", "c"], ["x"] * 4, fields)
        assert rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and meta["logged"]["reward/timeouts"] == 1.0
        # The worker that kept a cut-off call is replaced; the next batch is scored normally.
        assert score_responses(reward, ["a", "b"], ["x", "x"], [{}, {}])[0].tolist() == [1.0, 1.0]
    finally:
        reward.close()


def test_settings_that_cannot_work_are_named():
    for kwargs, message in [
        ({"workers": 0}, "reward.workers must be >= 1"),
        ({"worker_kind": "fibers"}, "reward.worker_kind must be one of thread, process"),
        ({"url": "ftp://x"}, "is not an http:// or https:// address"),
        ({"url": "http://127.0.0.1:1/", "fn": "exact"}, "set reward.url (a reward server) or reward.fn"),
    ]:
        with pytest.raises(RewardConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build_reward(kwargs.pop("fn", None), **kwargs)


class _JoinedHTTPServer(ThreadingHTTPServer):
    # Closing waits for every handler: one still answering a client that gave up would write to a
    # closed socket and print a traceback later, in another test. On CPython 3.11 that print parses
    # source (ast) in a second thread, which can fail the other test's own parse (python/cpython#106905).
    daemon_threads = False


class RewardServer:
    """A reward server on 127.0.0.1: reward = length of the response; ``fail_first`` requests get 503,
    ``delay_s`` is waited before answering (cut short when the server closes), ``short`` answers one
    reward too few."""

    def __init__(self, fail_first: int = 0, delay_s: float = 0.0, short: bool = False):
        self.requests: list[dict] = []
        self.fail_first, self.delay_s, self.short = fail_first, delay_s, short
        self.closing = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if len(server.requests) <= server.fail_first:
                    self.send_error(503, "warming up")
                    return
                if server.closing.wait(server.delay_s):
                    return  # the client gave up long ago; no answer
                rewards = [
                    {"reward": float(len(r["response"])), "turns": len(r.get("messages", []))} for r in body["rows"]
                ]
                data = json.dumps({"rewards": rewards[:-1] if server.short else rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = _JoinedHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        assert not [t for t in threading.enumerate() if t.name.endswith("(process_request_thread)")]


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch):
    monkeypatch.setattr(remote_reward, "FIRST_PAUSE_S", 0.01)


def test_the_server_scores_the_rows_with_their_prompt_and_messages():
    with RewardServer() as server:
        scores = scored(build_reward(None, url=server.url, workers=2), ["a", "bbb", "cc"])
    assert [(s["reward"], s["turns"]) for s in scores] == [(1.0, 1.0), (3.0, 1.0), (2.0, 1.0)]
    rows = [row for request in server.requests for row in request["rows"]]
    assert len(server.requests) == 2 and sorted(r["response"] for r in rows) == ["a", "bbb", "cc"]
    assert rows[0]["prompt"] == "p" and rows[0]["ground_truth"] == "x"


def test_a_failing_server_is_asked_again():
    with RewardServer(fail_first=2) as server:
        assert [s["reward"] for s in scored(build_reward(None, url=server.url), ["ab"])] == [2.0]
    assert len(server.requests) == 3


def test_a_server_that_stays_down_stops_the_step():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(RewardServerError, match=r"gave no rewards \(.*refused.*\) after 3 tries; start it"):
        RemoteReward(f"http://127.0.0.1:{port}/", timeout_s=1).score_batch([("a", "x", {})])


def test_a_server_slower_than_the_timeout_stops_the_step():
    with RewardServer(delay_s=2) as server:
        with pytest.raises(RewardServerError, match="after 2 tries"):
            RemoteReward(server.url, timeout_s=0.2, retries=2).score_batch([("a", "x", {})])


def test_a_reply_without_a_reward_per_row_stops_the_step():
    with RewardServer(short=True) as server:
        with pytest.raises(RewardServerError, match=r"one reward per row \(2\)"):
            RemoteReward(server.url, timeout_s=5).score_batch([("a", "x", {}), ("b", "x", {})])


def test_training_stops_without_training_on_missing_rewards(tiny_tokenizer, tmp_path):
    from conftest import family_model

    from rlvr.cli import main
    from rlvr.training.metrics_log import read_metrics

    model_dir = tmp_path / "model"
    family_model("qwen2", tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    argv = ["train", "--model.name_or_path", str(model_dir), "--out", str(run), "--policy_device", "cpu"]
    argv += ["--data.train_source", "arith:steps=1", "--data.val_size", "0"]
    argv += ["--reward.url", f"http://127.0.0.1:{port}/"]
    argv += ["--reward.timeout_s", "1", "--n_steps", "2", "--eval_every", "0", "--save_every", "0", "--log.no-progress"]
    argv += ["--rollout.n_prompts_per_rollout_batch", "2", "--rollout.group_size", "2"]
    argv += ["--rollout.max_new_tokens", "4", "--optim.gradient_accumulation_steps", "1"]
    assert main(argv) == 1
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or all(r["step"] == 0 for r in read_metrics(metrics))


def test_training_scores_with_the_configured_workers(spec, tiny_tokenizer, tmp_path):
    """reward.workers and reward.worker_kind reach the trainer's reward: two worker processes score a step."""
    from conftest import family_model

    from rlvr.cli import main
    from rlvr.training.metrics_log import read_metrics

    model_dir = tmp_path / "model"
    family_model("qwen2", tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    run = tmp_path / "run"
    argv = ["train", "--model.name_or_path", str(model_dir), "--out", str(run), "--policy_device", "cpu"]
    argv += ["--data.train_source", "arith:steps=1", "--data.val_size", "0", "--reward.fn", spec("records_process")]
    argv += ["--reward.workers", "2", "--reward.worker_kind", "process", "--n_steps", "1", "--save_every", "0"]
    argv += ["--rollout.n_prompts_per_rollout_batch", "2", "--rollout.group_size", "2", "--log.no-progress"]
    argv += ["--rollout.max_new_tokens", "4", "--optim.gradient_accumulation_steps", "1", "--eval_every", "0"]
    assert main(argv) == 0
    step = read_metrics(run / "metrics.jsonl")[-1]
    assert step["train/reward"] == 1.0 and step["train/reward/timeouts"] == 0
    # Four rows shared between two worker processes, two each (the file is in the test's directory).
    pids = (tmp_path / "scoring_processes.txt").read_text().split()
    assert len(pids) == 4 and sorted(pids.count(p) for p in set(pids)) == [2, 2]
