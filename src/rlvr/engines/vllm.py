"""A client for a vLLM server used as the rollout engine (optional extra: ``pip install rlvr[vllm]``).

**Not exercised against a real server here.** vLLM does not install on our machines, so this module
is written from vLLM's documented HTTP API and tested only against recorded-shape fixtures served by a
local HTTP server (``tests/engines/test_vllm_engine.py``). It is opt-in (``engine.name: vllm``): no shipped config
uses it. Treat the first run on a GPU box as its real test.

The protocol (the course's vLLM protocol):

* **start**: ``vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'`` with
  ``VLLM_SERVER_DEV_MODE=1`` (which exposes the weight-transfer routes), bf16, prefix caching, on its
  own GPU (``CUDA_VISIBLE_DEVICES``); ready when ``GET /health`` answers 200.
* **generate**: ``POST /v1/completions`` with ``n``, ``seed``, ``stop``,
  ``include_stop_str_in_output``, ``return_token_ids`` and ``logprobs: 0`` (the sampled token's
  log-prob only); choice ``index`` ``i * n + j`` is sample ``j`` of prompt ``i``.
* **sync** (once): ``GET /get_world_size``, then ``POST /init_weight_transfer_engine`` with
  ``{"init_info": {master_address, master_port, rank_offset, world_size}}`` while the trainer joins the
  NCCL group with ``NCCLWeightTransferEngine.trainer_init``; (every step): ``POST /pause``,
  ``POST /update_weights`` with ``{"update_info": {names, dtype_names, shapes, packed}}`` while
  ``NCCLWeightTransferEngine.trainer_send_weights`` streams the parameters, ``POST /reset_prefix_cache``,
  ``POST /resume``. The trainer's side of both is a ``WeightTransport`` (``NCCLWeightTransport`` unless
  the engine is given another).
* **check**: like the worker engine, every sync ends with a probe: the server's prompt log-probs of a
  fixed batch (``prompt_logprobs``) against the trainer's teacher-forced log-probs; a difference above
  ``probe_tolerance`` raises ``WeightSyncError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import requests

from rlvr.engines.base import Completion, SamplingParams
from rlvr.engines.hf import sequence_logprobs
from rlvr.engines.worker import PROBE_TEXTS, WeightSyncError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


class WeightTransport(Protocol):
    """The trainer's side of a weight sync: ``init`` joins the server's workers once (the trainer is
    rank 0 of ``world_size``) while the server answers ``/init_weight_transfer_engine``; ``send``
    streams the model's parameters, in ``named_parameters`` order, while it answers ``/update_weights``."""

    def init(self, world_size: int) -> None: ...

    def send(self, model: torch.nn.Module) -> None: ...


@dataclass
class NCCLWeightTransport:
    """vLLM's NCCL weight transfer, trainer side (vLLM's helpers, imported only when used)."""

    master_address: str = "127.0.0.1"
    master_port: int = 29551
    group: Any = None
    """The NCCL group joined by ``init``."""

    def init(self, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.group = NCCLWeightTransferEngine.trainer_init(
            dict(master_address=self.master_address, master_port=self.master_port, world_size=world_size)
        )

    def send(self, model: torch.nn.Module) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

        NCCLWeightTransferEngine.trainer_send_weights(
            iterator=model.named_parameters(), trainer_args=NCCLTrainerSendWeightsArgs(group=self.group, packed=True)
        )


class VLLMEngine:
    """Rollouts from a vLLM server; weights pushed to it over NCCL.

    ``served_model`` is what the server loads (a hub id or directory; default: the trainer model's
    ``config._name_or_path``). With ``start_server`` the engine launches ``vllm serve`` itself on
    ``gpu``; otherwise it talks to a server already running at ``base_url``. ``weight_transport`` moves
    the weights (default: ``NCCLWeightTransport`` at ``master_address:master_port``, which the server is
    told too).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        served_model: str | None = None,
        base_url: str | None = None,
        port: int = 8000,
        gpu: str = "1",
        start_server: bool = True,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
        master_address: str = "127.0.0.1",
        master_port: int = 29551,
        probe_tolerance: float = 0.25,
        check_sync: bool = True,
        session: requests.Session | None = None,
        weight_transport: WeightTransport | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        served = served_model or getattr(getattr(model, "config", None), "_name_or_path", None)
        if not served:
            raise ValueError("VLLMEngine needs served_model: the hub id or directory the server should load")
        self.served_model: str = served
        self.port = port
        self.base_url = (base_url or f"http://127.0.0.1:{port}").rstrip("/")
        self.gpu = gpu
        self.extra_args = tuple(extra_args)
        self.request_timeout_s = request_timeout_s
        self.master_address, self.master_port = master_address, master_port
        self.probe_tolerance = probe_tolerance
        self.check_sync = check_sync
        self.session = session or requests.Session()
        self.weight_transport = weight_transport or NCCLWeightTransport(master_address, master_port)
        self._proc: subprocess.Popen | None = None
        self._transfer_ready = False
        if start_server:
            self.start(startup_timeout_s)

    # -- server lifecycle -----------------------------------------------------------------------
    def server_command(self) -> list[str]:
        return [
            "vllm",
            "serve",
            self.served_model,
            "--weight-transfer-config",
            json.dumps({"backend": "nccl"}),
            "--dtype",
            "bfloat16",
            "--enable-prefix-caching",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def server_env(self) -> dict:
        return {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": str(self.gpu)}

    def start(self, timeout_s: float = 900.0) -> None:
        try:
            self._proc = subprocess.Popen(self.server_command(), env=self.server_env())
        except FileNotFoundError:
            raise RuntimeError(
                "`vllm` is not installed: `pip install rlvr[vllm]` on a CUDA machine, or use the hf or hf-worker engine"
            ) from None
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 900.0, poll_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"`vllm serve` exited with code {self._proc.returncode} before becoming healthy")
            try:
                if self.session.get(f"{self.base_url}/health", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server at {self.base_url} was not healthy after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    # -- HTTP -----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        url = f"{self.base_url}{path}"
        resp = self.session.request(method, url, json=payload, timeout=self.request_timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM server: {method} {path} returned {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else {}

    # -- generation -----------------------------------------------------------------------------
    def completion_request(self, prompts: list, params: SamplingParams) -> dict:
        return {
            "model": self.served_model,
            "prompt": list(prompts),
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "seed": params.seed,
            "stop": list(params.stop),
            "include_stop_str_in_output": params.include_stop_str_in_output,
            "return_token_ids": True,
            "logprobs": 0,
        }

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        body = self._request("POST", "/v1/completions", self.completion_request(prompts, params))
        return parse_completions(body, len(prompts), params.n)

    # -- weight sync ----------------------------------------------------------------------------
    def _post_while(self, path: str, payload: dict, work: Callable[[], object]) -> None:
        """POST ``path`` in a thread (the server blocks in NCCL) while ``work()`` runs here."""
        errors: list[BaseException] = []

        def post() -> None:
            try:
                self._request("POST", path, payload)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        work()
        thread.join()
        if errors:
            raise errors[0]

    def init_weight_transfer(self) -> None:
        inference_world = int(self._request("GET", "/get_world_size")["world_size"])
        world_size = inference_world + 1  # the trainer is rank 0, the server's workers follow
        init_info = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": world_size,
        }
        self._post_while(
            "/init_weight_transfer_engine", {"init_info": init_info}, lambda: self.weight_transport.init(world_size)
        )
        self._transfer_ready = True

    def sync_weights(self, model: torch.nn.Module) -> dict:
        t0 = time.perf_counter()
        if not self._transfer_ready:
            self.init_weight_transfer()
        names, dtype_names, shapes = [], [], []
        for name, p in model.named_parameters():
            names.append(name)
            dtype_names.append(str(p.dtype).removeprefix("torch."))
            shapes.append(list(p.shape))
        update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, "packed": True}
        self._request("POST", "/pause")
        try:
            self._post_while("/update_weights", {"update_info": update_info}, lambda: self.weight_transport.send(model))
            self._request("POST", "/reset_prefix_cache")
        finally:
            self._request("POST", "/resume")
        info = {"time/sync": time.perf_counter() - t0}
        if self.check_sync:
            diff = self.probe_diff(model)
            info["sync/probe_max_abs_diff"] = diff
            if not diff <= self.probe_tolerance:
                raise WeightSyncError(
                    f"the vLLM server's weights do not match the trainer's after a sync: probe log-probs differ "
                    f"by up to {diff:.4g} (tolerance {self.probe_tolerance:.3g}). Check that the server loaded "
                    f"the same architecture, and that update_weights received every parameter."
                )
        return info

    def probe_diff(self, model: torch.nn.Module) -> float:
        """Max |server − trainer| over the probe batch's prompt log-probs."""
        import torch

        worst = 0.0
        device = next(model.parameters()).device
        for text in PROBE_TEXTS:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            body = self._request(
                "POST",
                "/v1/completions",
                {
                    "model": self.served_model,
                    "prompt": ids,
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "prompt_logprobs": 0,
                },
            )
            server = parse_prompt_logprobs(body["choices"][0], ids)
            t = torch.tensor([ids], device=device)
            mine = sequence_logprobs(model, t, torch.ones_like(t))[0].float().cpu()
            worst = max(worst, float((mine - torch.tensor(server)).abs().max()))
        return worst


def parse_completions(body: dict, n_prompts: int, n: int) -> list[list[Completion]]:
    """Map a ``/v1/completions`` response to ``n`` completions per prompt (choice ``i*n + j``)."""
    choices = sorted(body["choices"], key=lambda c: c["index"])
    if len(choices) != n_prompts * n:
        raise RuntimeError(f"vLLM returned {len(choices)} choices for {n_prompts} prompts x n={n}")
    out: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM choice {c['index']} ended with finish_reason={c.get('finish_reason')!r}; "
                "was the server paused or the request aborted?"
            )
        if c.get("token_ids") is None:
            raise RuntimeError("the vLLM response has no token_ids; the server must support return_token_ids")
        lp = c.get("logprobs")
        logprobs = [float(x) for x in lp["token_logprobs"]] if lp and lp.get("token_logprobs") is not None else None
        meta = {"stop_reason": c["stop_reason"]} if c.get("stop_reason") is not None else {}
        out[c["index"] // n].append(
            Completion(
                text=c["text"],
                token_ids=list(c["token_ids"]),
                finish_reason=c["finish_reason"],
                logprobs=logprobs,
                meta=meta,
            )
        )
    return out


def parse_prompt_logprobs(choice: dict, prompt_ids: list[int]) -> list[float]:
    """The log-prob of each prompt token after the first, from vLLM's ``prompt_logprobs`` (a list with
    ``None`` first, then ``{token_id: {"logprob": x, ...}}`` per position)."""
    entries = choice["prompt_logprobs"]
    if len(entries) != len(prompt_ids):
        raise RuntimeError(f"prompt_logprobs has {len(entries)} entries for {len(prompt_ids)} prompt tokens")
    out = []
    for tok, entry in zip(prompt_ids[1:], entries[1:]):
        out.append(float(entry[str(tok)]["logprob"]))
    return out
