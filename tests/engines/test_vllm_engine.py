"""The vLLM client against fixtures written from vLLM's documented API, served by a real local HTTP server:
the exact requests sent (and their order during a sync) and the mapping of responses to Completions."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from rlvr.engines.base import SamplingParams
from rlvr.engines.hf import sequence_logprobs
from rlvr.engines.vllm import NCCLWeightTransport, VLLMEngine, parse_completions, parse_prompt_logprobs
from rlvr.engines.worker import PROBE_TEXTS, WeightSyncError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


class Status:
    """A route's answer with a status other than 200."""

    def __init__(self, code: int, body: dict):
        self.code, self.body = code, body


class RouteServer(ThreadingHTTPServer):
    """A real HTTP server on a free local port that answers from a route table of ``(method, path) -> body``
    (a JSON-able body, a callable of the request's JSON body, or a ``Status``) and records every request."""

    def __init__(self, routes: dict):
        super().__init__(("127.0.0.1", 0), RouteHandler)
        self.routes = routes
        self.calls: list[tuple[str, str, dict | None]] = []
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


class RouteHandler(BaseHTTPRequestHandler):
    server: RouteServer

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.calls.append((self.command, self.path, body))
        answer = self.server.routes[(self.command, self.path)]
        answer = answer(body) if callable(answer) else answer
        code, answer = (answer.code, answer.body) if isinstance(answer, Status) else (200, answer)
        content = b"" if answer is None else json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = _answer

    def log_message(self, format, *args):  # keep the test output quiet
        pass


@pytest.fixture()
def serve():
    """Start route servers for a test; all are shut down after it."""
    servers: list[RouteServer] = []

    def start(routes: dict) -> RouteServer:
        servers.append(RouteServer(routes))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def engine_with(serve, tiny_model, tiny_tokenizer):
    """``(engine, server)``: a VLLMEngine (no server process of its own) talking to a route server."""

    def make(routes, **kw):
        server = serve(routes)
        engine = VLLMEngine(
            tiny_model,
            tiny_tokenizer,
            served_model="allenai/OLMo-2-0425-1B",
            start_server=False,
            base_url=f"http://127.0.0.1:{server.port}",
            **kw,
        )
        return engine, server

    return make


def test_server_command_and_env(engine_with):
    engine, _ = engine_with({}, port=8123, gpu="1")
    cmd = engine.server_command()
    assert cmd[:3] == ["vllm", "serve", "allenai/OLMo-2-0425-1B"]
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8123"
    env = engine.server_env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"


def test_health_wait(engine_with):
    engine, server = engine_with({("GET", "/health"): {}})
    engine.wait_healthy(timeout_s=1, poll_s=0)
    assert server.calls == [("GET", "/health", None)]


def test_generate_request_and_response_mapping(engine_with):
    engine, server = engine_with({("POST", "/v1/completions"): fixture("completions_n2.json")})
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=512, stop=("</answer>",), seed=3)
    out = engine.generate(["p0", "p1"], params)
    ((method, path, body),) = server.calls
    assert (method, path) == ("POST", "/v1/completions")
    assert body == {
        "model": "allenai/OLMo-2-0425-1B",
        "prompt": ["p0", "p1"],
        "n": 2,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 512,
        "seed": 3,
        "stop": ["</answer>"],
        "include_stop_str_in_output": True,
        "return_token_ids": True,
        "logprobs": 0,
    }
    assert [len(g) for g in out] == [2, 2]
    first = out[0][0]  # choice index 0: prompt 0, sample 0
    assert first.text.endswith("</answer>") and first.finish_reason == "stop"
    assert first.token_ids == [5332, 1000, 1001, 5332, 1002]
    assert first.logprobs == [-0.25, -0.5, -1.0, -0.0625, -0.03125]
    assert first.meta == {"stop_reason": "</answer>"}
    assert out[0][1].finish_reason == "length" and out[0][1].token_ids == [2166, 611, 220, 284, 1187]
    assert out[1][0].text == " 10" and out[1][1].token_ids == [100257] and out[1][1].finish_reason == "stop"
    assert all(len(c.logprobs) == len(c.token_ids) for g in out for c in g)


def test_parse_rejects_aborted_and_missing_token_ids():
    body = fixture("completions_n2.json")
    body["choices"][0]["finish_reason"] = "abort"
    with pytest.raises(RuntimeError, match="finish_reason"):
        parse_completions(body, 2, 2)
    body = fixture("completions_n2.json")
    del body["choices"][0]["token_ids"]
    with pytest.raises(RuntimeError, match="token_ids"):
        parse_completions(body, 2, 2)
    with pytest.raises(RuntimeError, match="choices"):
        parse_completions(fixture("completions_n2.json"), 3, 2)


def test_parse_prompt_logprobs_reads_the_actual_token():
    choice = fixture("prompt_logprobs.json")["choices"][0]
    assert parse_prompt_logprobs(choice, [32, 33, 34]) == [-1.5, -0.25]


def _probe_route(model, tokenizer, shift=0.0):
    """A /v1/completions handler that answers probe requests with ``model``'s own prompt log-probs."""

    def answer(body):
        ids = body["prompt"]
        t = torch.tensor([ids])
        lp = sequence_logprobs(model, t, torch.ones_like(t))[0].tolist()
        entries = [None] + [
            {str(tok): {"logprob": x + shift, "rank": 1, "decoded_token": "?"}} for tok, x in zip(ids[1:], lp)
        ]
        return {
            "choices": [
                {"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": entries, "token_ids": [0]}
            ]
        }

    return answer


def _sync_routes(model, tokenizer, shift=0.0):
    return {
        ("GET", "/get_world_size"): fixture("get_world_size.json"),
        ("POST", "/init_weight_transfer_engine"): fixture("init_weight_transfer_engine.json"),
        ("POST", "/pause"): fixture("pause.json"),
        ("POST", "/update_weights"): fixture("update_weights.json"),
        ("POST", "/reset_prefix_cache"): None,
        ("POST", "/resume"): fixture("resume.json"),
        ("POST", "/v1/completions"): _probe_route(model, tokenizer, shift),
    }


class RecordingTransport:
    """A weight transport that moves nothing: it records each call and raises ``send_error`` from
    ``send`` when one is set."""

    def __init__(self, send_error: Exception | None = None):
        self.send_error = send_error
        self.calls: list[tuple] = []

    def init(self, world_size: int) -> None:
        self.calls.append(("init", world_size))

    def send(self, model: torch.nn.Module) -> None:
        self.calls.append(("send", model))
        if self.send_error is not None:
            raise self.send_error


def test_the_default_transport_is_nccl_at_the_engines_master_address(engine_with):
    engine, _ = engine_with({}, master_address="10.0.0.2", master_port=29999)
    assert engine.weight_transport == NCCLWeightTransport("10.0.0.2", 29999)


def test_sync_protocol_order_and_payloads(engine_with, tiny_model, tiny_tokenizer):
    transport = RecordingTransport()
    engine, server = engine_with(
        _sync_routes(tiny_model, tiny_tokenizer),
        master_address="10.0.0.2",
        master_port=29999,
        weight_transport=transport,
    )
    info = engine.sync_weights(tiny_model)
    info2 = engine.sync_weights(tiny_model)
    assert transport.calls == [("init", 2), ("send", tiny_model), ("send", tiny_model)]
    control = [(m, p) for m, p, _ in server.calls if p != "/v1/completions"]
    step = [("POST", "/pause"), ("POST", "/update_weights"), ("POST", "/reset_prefix_cache"), ("POST", "/resume")]
    assert control == [("GET", "/get_world_size"), ("POST", "/init_weight_transfer_engine")] + step + step
    bodies = {p: b for m, p, b in server.calls}
    assert bodies["/init_weight_transfer_engine"] == {
        "init_info": {"master_address": "10.0.0.2", "master_port": 29999, "rank_offset": 1, "world_size": 2}
    }
    update = bodies["/update_weights"]["update_info"]
    params = list(tiny_model.named_parameters())
    assert update["names"] == [n for n, _ in params]
    assert update["dtype_names"] == ["float32"] * len(params)
    assert update["shapes"] == [list(p.shape) for _, p in params]
    assert update["packed"] is True
    probes = [b for m, p, b in server.calls if p == "/v1/completions"]
    assert len(probes) == 2 * len(PROBE_TEXTS) and all(b["prompt_logprobs"] == 0 for b in probes)
    assert info["sync/probe_max_abs_diff"] == pytest.approx(0.0, abs=1e-6) and "time/sync" in info2


def test_sync_check_catches_a_stale_server(engine_with, tiny_model, tiny_tokenizer):
    routes = _sync_routes(tiny_model, tiny_tokenizer, shift=0.5)
    engine, server = engine_with(routes, weight_transport=RecordingTransport())
    with pytest.raises(WeightSyncError, match="do not match"):
        engine.sync_weights(tiny_model)
    assert [p for _, p, _ in server.calls].count("/resume") == 1  # generation is resumed even so


def test_resume_even_when_update_fails(engine_with, tiny_model, tiny_tokenizer):
    routes = _sync_routes(tiny_model, tiny_tokenizer)
    engine, server = engine_with(routes, weight_transport=RecordingTransport(send_error=RuntimeError("nccl broke")))
    with pytest.raises(RuntimeError, match="nccl broke"):
        engine.sync_weights(tiny_model)
    # The update's POST runs in a thread the client does not wait for once the send failed (the server may
    # be stuck in NCCL), so it may reach the server after /resume.
    paths = [p for _, p, _ in server.calls if p != "/update_weights"]
    assert paths[-2:] == ["/pause", "/resume"]


def test_http_errors_name_the_route(engine_with):
    engine, _ = engine_with({("POST", "/v1/completions"): Status(500, {"error": "boom"})})
    with pytest.raises(RuntimeError, match="/v1/completions returned 500"):
        engine.generate(["x"], SamplingParams())
