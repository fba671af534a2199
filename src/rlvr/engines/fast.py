"""Fast in-process sampling for OLMo-2 models: a static KV cache and a CUDA-graph decode step.

``FastHFEngine`` (engine name ``hf-fast``) has ``HFEngine``'s interface and samples from the same
distribution; it differs in how the work reaches the GPU:

* **Static KV cache, prompt stored once per group.** Two preallocated, zero-filled K and V buffers
  per layer: the prompt cache (prompts, heads, prompt slots, head_dim), which holds each prompt once
  however many samples it has, and the response cache (rows, heads, response slots, head_dim). The
  prompts of a chunk are left-padded to a common length L; every row starts generating together, so
  step ``s`` writes response slot ``s - 1`` for every row at once. Position ids count only real
  tokens, exactly as ``HFEngine`` (a padded prompt sees the positions of an unpadded one). At the
  suggested config (32 prompts of ~160 tokens x 8 samples, 512 new tokens) sharing the prompt saves
  about a quarter of the cache.
* **Own decode step over the model's weights.** The step calls the model's own submodules
  (projections, RMS norms, MLP, LM head) but does the attention itself against the static buffers,
  so there is no Python cache object and no data-dependent host sync in the step. That is what makes
  it capturable. The cost is that only OLMo-2's layer layout is supported (post-norm blocks,
  q/k RMS norm over all heads); other architectures raise and should use ``hf``.
* **One CUDA graph per (batch bucket, sampling mode)**, and per length bucket on the SDPA path. A
  graph replays one whole
  step: embedding, 16 layers, LM head, sampling, log-prob, writing the token and log-prob to the
  output buffers and advancing the position/slot/step counters on the device. The host launches
  replays back to back. Attention (``rlvr.engines.decode_attention``) reads each row's prompt slots
  from its group's entry and its filled response slots: on CUDA one Triton kernel that reads the
  lengths on the device (one graph per batch bucket), elsewhere a gather and SDPA over the filled
  slots rounded up to ``length_bucket``. With several samples per prompt and a large enough batch
  bucket (``cascade_min_rows``), the Triton path reads each shared prompt once per step for all of
  its rows (cascade attention) and each row then reads only its response.
* **Prefill once per prompt.** The chunk's prompts are prefilled once (causal, padding-masked) into
  the prompt cache, through the same compiled pieces as the decode step; the ``n`` rows of a prompt's
  samples point at it.
* **Sampling inside the graph.** Exponential race: with E_i ~ Exp(1) drawn from the caller's seeded
  generator, ``argmax_i p_i / E_i`` is distributed exactly as a draw from ``p`` (the same
  distribution as ``torch.multinomial``, not the same draws as ``HFEngine``); it is computed as
  ``argmax_i (score_i - log E_i)``, which needs no softmax pass over the vocabulary. The noise buffer is
  filled outside the graph by one kernel per step, so the seeded generator needs no graph
  registration and the same seed reproduces the batch. Temperature 0 is argmax; top-p keeps the
  smallest set of tokens whose mass reaches p (same rule as ``hf.sample_next``). The sampled
  token's log-probability under the temperature-1 full-vocabulary distribution comes from the
  same logits.
* **Few host syncs, overlapped.** The host reads the new tokens every ``sync_every`` steps and checks
  EOS and stop strings then, one sync period behind the device (the copy is asynchronous and the
  device runs the next steps while the host examines), token by token as ``HFEngine`` does (a stop found in the decoded new span is
  located at the exact token that completed it), so rows that ran past their stop are cut on the host
  and text, token ids, log-probs and finish reasons equal per-token checking.
* **Retiring rows.** A row the host finds finished is flagged on the device at once, and the
  attention skips it from the next step on; when the rows still running fit a smaller batch bucket,
  they move to the first batch rows and the smaller bucket's graph takes over. Only the per-row
  indices move: each row keeps its response cache row (``_State.crow``), so no K/V is copied.

On CPU (or with ``use_cuda_graphs=False``) the same step runs eagerly; CPU tests prove it equals
``HFEngine`` and ``model.generate``.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlvr.engines.base import Completion, SamplingParams
from rlvr.engines.decode_attention import (default_splits, prompt_runs, reference_decode_attention,
                                           triton_available, triton_decode_attention)
from rlvr.engines.hf import _stop_window_tokens, eos_token_ids, find_stop, generate_in_chunks, truncate_at_stop

DEFAULT_BATCH_BUCKETS = (256, 192, 128, 96, 64, 48, 32, 24, 16, 8, 4, 2, 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as transformers' apply_rotary_pos_emb: float32 cos/sin, result cast back.
    return ((x * cos) + (_rotate_half(x) * sin)).to(x.dtype)


# --- the decode step's pieces as pure functions of tensors (``compile_step``) --------------------------
# Each decoder layer's step is: projections, q/k norms and rotary embedding (``_pre_attention``), the
# cache write and attention (left eager: in-place writes into the static cache), then the output
# projection, norms, residuals and MLP (``_post_attention``). Written over plain tensors, so one
# compiled graph serves all layers (the weights are its inputs); inductor fuses each piece's
# elementwise work into a few kernels. At a 2,048-wide model a decode step is mostly kernel count:
# eager it is about 50 kernels per layer, each a few microseconds even inside a CUDA graph.

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def _project(x, ws: tuple, parts: int):
    """``parts`` projections of x: one matmul with the rows of the weights stacked (``ws`` = (stacked,)),
    or one matmul per weight. Stacked, a decode step reads the same bytes in fewer, larger kernels."""
    if len(ws) == 1:
        return F.linear(x, ws[0]).chunk(parts, dim=-1)
    return tuple(F.linear(x, w) for w in ws)


def _pre_attention(x, wqkv: tuple, wqn, wkn, eps: float, cos, sin, heads: int):
    B, Q, _ = x.shape
    q, k, v = _project(x, wqkv, 3)
    q = _rms(q, wqn, eps).view(B, Q, heads, -1).transpose(1, 2)
    k = _rms(k, wkn, eps).view(B, Q, heads, -1).transpose(1, 2)
    v = v.view(B, Q, heads, -1).transpose(1, 2)
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


def _post_attention(x, o, wo, wpan, wgate_up: tuple, wdown, wpfn, eps: float):
    B, Q, _ = x.shape
    x = x + _rms(F.linear(o.transpose(1, 2).reshape(B, Q, -1), wo), wpan, eps)
    gate, up = _project(x, wgate_up, 2)
    return x + _rms(F.linear(F.silu(gate) * up, wdown), wpfn, eps)


def _sample_math(logits, vocab_bias, temperature, top_p, noise, mode: str):
    """Tokens and their temperature-1 log-probs for logits (b, vocab); ``noise`` holds Exp(1) draws."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    scores = logits + vocab_bias
    if mode == "greedy":
        tokens = scores.argmax(dim=-1)
    else:
        scores = scores / temperature
        if mode == "top_p":
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            p_sorted = sorted_scores.softmax(dim=-1)
            drop = (p_sorted.cumsum(dim=-1) - p_sorted) >= top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
        # argmax p_i / E_i = argmax (log p_i - log E_i) = argmax (score_i - log E_i): the normaliser is
        # the same for every i, so no softmax pass is needed (-log E_i is Gumbel noise).
        tokens = (scores - noise.clamp_min(1e-30).log()).argmax(dim=-1)
    lp = logits.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, lp


@functools.cache
def _compiled(fn):
    """``torch.compile(fn, dynamic=True)``, once per process (batch size and length stay symbolic)."""
    return torch.compile(fn, dynamic=True)


def _check_architecture(model):
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    ok = layers is not None and len(layers) > 0 and hasattr(model, "lm_head")
    if ok:
        layer = layers[0]
        attn = getattr(layer, "self_attn", None)
        ok = (attn is not None and all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))
              and hasattr(layer, "post_attention_layernorm") and hasattr(layer, "post_feedforward_layernorm")
              and not hasattr(layer, "input_layernorm"))
    if not ok:
        raise ValueError(
            f"FastHFEngine supports OLMo-2's layer layout only (post-norm blocks with q/k norms); got "
            f"{type(model).__name__}. Use the 'hf' engine for this model."
        )
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if "dynamic" in str(rope_type) or "longrope" in str(rope_type):
        raise ValueError(f"FastHFEngine needs a static RoPE; rope_type {rope_type!r} changes with length. Use 'hf'.")
    if getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) != cfg.num_attention_heads:
        raise ValueError("FastHFEngine assumes no grouped-query attention (num_key_value_heads == num_attention_heads).")


@dataclass
class _State:
    """Device buffers every graph reads and writes (fixed addresses for the graphs' lifetime)."""

    pk: list[torch.Tensor]     # per layer (groups_cap, heads, prompt_slots_cap, head_dim): prompt K
    pv: list[torch.Tensor]     # prompt V
    rk: list[torch.Tensor]     # per layer (rows_cap, heads, response_slots_cap, head_dim): response K
    rv: list[torch.Tensor]     # response V
    tok: torch.Tensor          # (rows_cap,) token fed to the next step
    pos: torch.Tensor          # (rows_cap,) its position id
    grp: torch.Tensor          # (rows_cap,) prompt-cache entry of the row (its prompt)
    start: torch.Tensor        # (rows_cap,) first real prompt slot of the row (left padding before it)
    row_id: torch.Tensor       # (rows_cap,) output row the batch row writes to (scratch row for fillers)
    live: torch.Tensor         # (rows_cap,) int32: 0 for fillers and rows the host found finished (attention skips them)
    runs: torch.Tensor         # (2, rows_cap) int32: first row and row count of each run of rows sharing a prompt
    crow: torch.Tensor         # (rows_cap,) cache row of rk/rv holding the batch row's response K/V
    plen: torch.Tensor         # (1,) prompt slots in use (the chunk's padded prompt length)
    slot: torch.Tensor         # (1,) response slot the next step writes
    step: torch.Tensor         # (1,) output column the next step writes
    noise: torch.Tensor        # (rows_cap, vocab) Exp(1) noise for the exponential race
    temperature: torch.Tensor  # (1,) float32
    top_p: torch.Tensor        # (1,) float32
    vocab_bias: torch.Tensor   # (vocab,) 0, or -inf on ids the tokenizer cannot decode
    out_tok: torch.Tensor      # (rows_cap + 1, steps_cap) sampled tokens; last row is scratch
    out_lp: torch.Tensor       # (rows_cap + 1, steps_cap) their log-probs
    wqkv: list                 # per layer: (stacked q/k/v weight,), refreshed from the model every chunk; or []
    wgate_up: list             # per layer: (stacked gate/up weight,); or []

    @property
    def rows_cap(self) -> int:
        return self.tok.shape[0]

    @property
    def groups_cap(self) -> int:
        return self.pk[0].shape[0]

    @property
    def prompt_slots_cap(self) -> int:
        return self.pk[0].shape[2]

    @property
    def slots_cap(self) -> int:
        """Response slots."""
        return self.rk[0].shape[2]

    @property
    def steps_cap(self) -> int:
        return self.out_tok.shape[1]


class FastHFEngine:
    """Static-cache, CUDA-graph sampling with an OLMo-2 causal LM in this process.

    Holds a reference to ``model`` (no copy): trainer updates are visible at once, since graphs read
    the parameters in place (an optimizer step updates them in place; replacing a parameter tensor
    needs ``sync_weights``, which drops the graphs).

    ``max_batch_size`` bounds the rows decoded together (prompts × n); ``batch_buckets`` are the
    batch sizes graphs are captured for; ``length_bucket`` rounds the attended cache length;
    ``sync_every`` is how many steps run between host checks of EOS / stop strings (4 was faster than 8
    on an H200: finished rows are flagged and retired sooner). ``attention``
    is ``"triton"`` (one kernel over the shared prompt and response caches; CUDA, or the Triton
    interpreter), ``"sdpa"`` (gather each row's prompt K/V and call SDPA; any device) or ``"auto"``
    (default: ``"triton"`` on CUDA when Triton is installed, else ``"sdpa"``); ``fused_norms``
    replaces each RMSNorm module call by one ``F.rms_norm`` on the same float32 values (fewer kernels
    per step). Both defaults were the fastest on an H200 (docs/benchmarks.md). ``compile_step`` runs
    the decode step's per-layer pieces and its sampling through ``torch.compile`` (fewer, fused
    kernels per step; compiled once, on the first call); ``None`` means on for CUDA with CUDA graphs,
    off elsewhere. It applies to OLMo-2's SiLU MLP without biases; other settings run eagerly.
    ``release_memory`` frees the static KV cache and the graphs after every ``generate`` call, so that a
    training step on the same GPU can use that memory; each call then allocates the cache and captures
    its graphs again (the compiled step is kept), which costs time (docs/benchmarks.md).
    ``fuse_projections`` (compiled step only) stacks each layer's q/k/v weights into one matrix and its
    gate/up weights into another, so a step runs two large matmuls instead of five small ones; the
    stacked copies (about half the model's weights) are refreshed from the model at the start of every
    chunk, so in-place weight updates between calls are seen. ``attention_splits`` (Triton path) fixes
    how many programs share a row's slots; ``None`` picks ``default_splits`` per batch bucket.
    ``cascade_min_rows`` (Triton path, ``n >= 2``): batch buckets of at least this many rows read each
    group's shared prompt once per step for all of the group's rows (one program per run of rows with
    one prompt, then each row reads only its own response slots); smaller buckets, where few rows share
    a prompt, read it per row. ``None`` turns this off.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 256, batch_buckets=DEFAULT_BATCH_BUCKETS,
                 length_bucket: int = 128, sync_every: int = 4, use_cuda_graphs: bool | None = None,
                 mask_unused_vocab: bool = True, prefill_tokens: int = 32768, attention: str = "auto",
                 fused_norms: bool = True, compile_step: bool | None = None, release_memory: bool = False,
                 fuse_projections: bool = True, attention_splits: int | None = None,
                 cascade_min_rows: int | None = 64):
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token = tokenizer.eos_token")
        _check_architecture(model)
        if max_batch_size < 1 or length_bucket < 1 or sync_every < 1:
            raise ValueError("max_batch_size, length_bucket and sync_every must all be >= 1")
        if cascade_min_rows is not None and cascade_min_rows < 1:
            raise ValueError(f"cascade_min_rows must be >= 1, or None to turn cascade attention off; got {cascade_min_rows}")
        if attention_splits is not None and (attention_splits < 1 or attention_splits & (attention_splits - 1)):
            raise ValueError(f"attention_splits must be a power of two >= 1 or None, got {attention_splits}")
        if attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'sdpa', got {attention!r}")
        if attention == "triton" and not triton_available():
            raise ValueError("attention='triton' needs the triton package (it ships with CUDA builds of torch); "
                             "use attention='sdpa'")
        self.model = model
        if compile_step and self._compilable() is not None:
            raise ValueError(f"compile_step=True does not apply to this model: {self._compilable()}; leave it None")
        self.attention = attention
        self.fused_norms = fused_norms
        self.compile_step = compile_step
        self.release_memory = release_memory
        self.fuse_projections = fuse_projections
        self.attention_splits = attention_splits
        self.cascade_min_rows = cascade_min_rows
        self._chunk_shape = (0, 1)  # (prompts, samples per prompt) of the chunk being decoded
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_buckets = tuple(sorted({b for b in batch_buckets if b < max_batch_size} | {max_batch_size}))
        self.length_bucket = length_bucket
        self.sync_every = sync_every
        self.use_cuda_graphs = use_cuda_graphs
        self.mask_unused_vocab = mask_unused_vocab
        self.prefill_tokens = prefill_tokens
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.stats = {"tokens": 0, "time": 0.0, "graphs_captured": 0, "capture_time": 0.0, "host_syncs": 0,
                      "compactions": 0, "rows_flagged": 0, "cascade_steps": 0}
        self._state: _State | None = None
        self._graphs: dict = {}
        self._pool = None
        self._captured_signature = None

    # ------------------------------------------------------------------ engine interface
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sync_weights(self, model) -> dict:
        if model is not self.model:
            _check_architecture(model)
            self.model = model
        # Optimizers update parameters in place, so captured graphs stay valid; only new parameter
        # tensors (a new model, a reloaded state) make them read stale memory.
        if self._param_signature() != self._captured_signature:
            self._drop_graphs()
        return {"time/sync": 0.0}

    def close(self) -> None:
        self._drop_graphs()
        self._state = None

    def _param_signature(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _drop_graphs(self) -> None:
        # A memory pool must not outlive the graphs it served: capturing new graphs into the pool of
        # destroyed ones trips the caching allocator, so every drop starts a fresh pool.
        self._graphs.clear()
        self._pool = None
        self._captured_signature = None

    def _graphs_enabled(self) -> bool:
        if self.use_cuda_graphs is None:
            return self.device.type == "cuda"
        return bool(self.use_cuda_graphs) and self.device.type == "cuda"

    def generate(self, prompts: list[str], params: SamplingParams, *,
                 row_max_new_tokens: list[list[int]] | None = None) -> list[list[Completion]]:
        """``row_max_new_tokens[i][j]`` (optional, for benchmarks) caps sample j of prompt i below
        ``params.max_new_tokens``: that row finishes with reason ``"length"`` there, as if it had
        reached its own limit, so a batch can retire rows at chosen lengths."""
        if prompts and params.n > self.max_batch_size:
            raise ValueError(f"n={params.n} exceeds max_batch_size={self.max_batch_size}; raise max_batch_size")

        def run_chunk(idx, prompt_ids, generator):
            limits = None
            if row_max_new_tokens is not None:
                limits = [min(int(x), params.max_new_tokens) for i in idx for x in row_max_new_tokens[i]]
            return self._generate_chunk(prompt_ids, params, generator, limits)

        try:
            return generate_in_chunks(self, prompts, params, run_chunk)
        finally:
            if self.release_memory:
                self.close()  # the trainer's step can use the cache's memory; the next call re-captures

    # ------------------------------------------------------------------ buffers
    def _ensure_state(self, rows: int, groups: int, prompt_slots: int, slots: int, steps: int):
        st = self._state
        model, device = self.model, self.device
        need = (rows, groups, prompt_slots, slots, steps)
        if st is not None:
            have = (st.rows_cap, st.groups_cap, st.prompt_slots_cap, st.slots_cap, st.steps_cap)
            if all(h >= n for h, n in zip(have, need)) and st.rk[0].dtype == model.lm_head.weight.dtype \
                    and st.rk[0].device == device:
                return st
            need = tuple(max(h, n) for h, n in zip(have, need))  # grow to cover the old and the new request
            del st  # let the old buffers go before the new ones are allocated
        rows, groups, prompt_slots, slots, steps = need
        self._drop_graphs()
        self._state = None
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = model.lm_head.weight.dtype
        vocab = model.lm_head.weight.shape[0]
        # Zero-filled: masked slots get weight exactly 0 in attention, and 0 * (finite) stays 0.
        zeros = lambda n, s: torch.zeros((n, heads, s, head_dim), dtype=dtype, device=device)  # noqa: E731
        layers = len(model.model.layers)
        bias = torch.zeros(vocab, dtype=torch.float32, device=device)
        limit = len(self.tokenizer)
        if self.mask_unused_vocab and limit < vocab:
            bias[limit:] = float("-inf")
        long = dict(dtype=torch.long, device=device)
        def stack(*ws):  # room for the weights' rows one under another; _refresh_stacked fills it
            return (torch.empty((sum(w.shape[0] for w in ws), ws[0].shape[1]), dtype=ws[0].dtype, device=ws[0].device),)

        wqkv, wgate_up = [], []
        if self._stacked_weights():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                wqkv.append(stack(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
                wgate_up.append(stack(mlp.gate_proj.weight, mlp.up_proj.weight))
        self._state = _State(
            pk=[zeros(groups, prompt_slots) for _ in range(layers)], pv=[zeros(groups, prompt_slots) for _ in range(layers)],
            rk=[zeros(rows, slots) for _ in range(layers)], rv=[zeros(rows, slots) for _ in range(layers)],
            tok=torch.zeros(rows, **long), pos=torch.zeros(rows, **long), grp=torch.zeros(rows, **long),
            start=torch.zeros(rows, **long), row_id=torch.full((rows,), rows, **long),
            live=torch.zeros(rows, dtype=torch.int32, device=device),
            runs=torch.zeros((2, rows), dtype=torch.int32, device=device), crow=torch.arange(rows, **long),
            plen=torch.zeros(1, **long),
            slot=torch.zeros(1, **long), step=torch.zeros(1, **long),
            noise=torch.ones((rows, vocab), dtype=torch.float32, device=device),
            temperature=torch.ones(1, dtype=torch.float32, device=device),
            top_p=torch.ones(1, dtype=torch.float32, device=device), vocab_bias=bias,
            out_tok=torch.zeros((rows + 1, steps), **long),
            out_lp=torch.zeros((rows + 1, steps), dtype=torch.float32, device=device),
            wqkv=wqkv, wgate_up=wgate_up,
        )
        return self._state

    def _stacked_weights(self) -> bool:
        """Whether decode steps use stacked q/k/v and gate/up weights (``fuse_projections``, compiled step)."""
        return self.fuse_projections and self._step_compiled()

    @torch.no_grad()
    def _refresh_stacked(self, st: _State) -> None:
        """Copy the model's current q/k/v and gate/up weights into the stacked buffers (in place: the
        captured graphs keep reading the same memory)."""
        for layer, (qkv,), (gate_up,) in zip(self.model.model.layers, st.wqkv, st.wgate_up):
            attn, mlp = layer.self_attn, layer.mlp
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], out=qkv)
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], out=gate_up)

    # ------------------------------------------------------------------ the model, by hand
    def _rope(self, pos: torch.Tensor):
        rot = self.model.model.rotary_emb
        freqs = pos.float()[..., None] * rot.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(rot, "attention_scaling", 1.0)
        return emb.cos() * scale, emb.sin() * scale

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_norms:
            return module(x)
        # One fused kernel instead of the module's seven elementwise ones; same float32 math
        # (the module multiplies its weight into the float32 normalised values, then casts).
        return _rms(x, module.weight, module.variance_epsilon)

    def _layers(self, x: torch.Tensor, cos, sin, attend):
        """Run every decoder layer on x (B, Q, hidden); ``attend(i, q, k, v)`` returns (B, H, Q, D)."""
        norm = self._norm
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            B, Q, _ = x.shape
            q = norm(attn.q_norm, attn.q_proj(x)).view(B, Q, -1, attn.head_dim).transpose(1, 2)
            k = norm(attn.k_norm, attn.k_proj(x)).view(B, Q, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(B, Q, -1, attn.head_dim).transpose(1, 2)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            o = attend(i, q, k, v).transpose(1, 2).reshape(B, Q, -1)
            x = x + norm(layer.post_attention_layernorm, attn.o_proj(o))
            x = x + norm(layer.post_feedforward_layernorm, layer.mlp(x))
        return norm(self.model.model.norm, x)

    def _prefill(self, st: _State, group0: int, input_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Prefill left-padded prompts (P, L); write their K/V to prompt-cache entries [group0, group0 + P),
        slots [0, L). Returns the last position's logits (P, vocab)."""
        P, L = input_ids.shape
        device = input_ids.device
        cols = torch.arange(L, device=device)
        positions = (cols[None, :] - starts[:, None]).clamp(min=0)
        cos, sin = self._rope(positions[:, None])  # broadcast over heads
        key_ok = cols[None, :] >= starts[:, None]                                # (P, L)
        causal = cols[None, :] <= cols[:, None]                                  # (L, L) [query, key]
        # A padding query attends to itself so that no row of the softmax is empty (no NaN in K/V).
        mask = causal[None] & (key_ok[:, None, :] | torch.eye(L, dtype=torch.bool, device=device)[None])
        mask = mask[:, None]                                                     # (P, 1, L, L)

        def attend(i, q, k, v):
            st.pk[i][group0:group0 + P, :, :L] = k
            st.pv[i][group0:group0 + P, :, :L] = v
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        x = self.model.model.embed_tokens(input_ids)
        h = (self._layers_compiled if self._step_compiled() else self._layers)(x, cos, sin, attend)
        return self.model.lm_head(h[:, -1])

    def _sample(self, st: _State, logits: torch.Tensor, b: int, mode: str, compiled: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their temperature-1 log-probs for logits (b, vocab); ``noise[:b]`` must hold Exp(1) draws."""
        fn = _compiled(_sample_math) if compiled else _sample_math
        return fn(logits, st.vocab_bias, st.temperature, st.top_p, st.noise[:b], mode)

    def _step_compiled(self) -> bool:
        """Whether decode steps run the compiled pieces (``compile_step``, resolved for this model)."""
        if self.compile_step is None:
            return self._graphs_enabled() and self._compilable() is None
        return bool(self.compile_step)

    def _compilable(self) -> str | None:
        """None when the compiled pieces apply to the model, else why not."""
        layer = self.model.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        act = getattr(self.model.config, "hidden_act", None)
        if act != "silu":
            return f"hidden_act {act!r} (the compiled step assumes silu)"
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj] + [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(not isinstance(m, torch.nn.Linear) or m.bias is not None for m in linears):
            return "projections with biases or of another kind"
        return None

    def _layers_compiled(self, x: torch.Tensor, cos, sin, attend):
        """``_layers`` through the compiled pieces (same math as ``fused_norms``)."""
        pre, post = _compiled(_pre_attention), _compiled(_post_attention)
        stacked = self._state is not None and bool(self._state.wqkv)
        for i, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            eps = attn.q_norm.variance_epsilon
            if stacked:
                wqkv, wgate_up = self._state.wqkv[i], self._state.wgate_up[i]
            else:
                wqkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
                wgate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
            q, k, v = pre(x, wqkv, attn.q_norm.weight, attn.k_norm.weight, eps, cos, sin,
                          self.model.config.num_attention_heads)
            o = attend(i, q, k, v)
            x = post(x, o, attn.o_proj.weight, layer.post_attention_layernorm.weight, wgate_up, mlp.down_proj.weight,
                     layer.post_feedforward_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        return _rms(x, self.model.model.norm.weight, self.model.model.norm.variance_epsilon)

    def _attention_kind(self) -> str:
        """``"triton"`` or ``"sdpa"``: ``attention`` resolved for this engine's device."""
        if self.attention == "auto":
            return "triton" if self.device.type == "cuda" and triton_available() else "sdpa"
        if self.attention == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention='triton' runs on CUDA (or under TRITON_INTERPRET=1); the model is on "
                             f"{self.device}: use attention='sdpa'")
        return self.attention

    def _decode_step(self, st: _State, b: int, slots: int, mode: str):
        """One step for batch rows [0, b): feed ``tok``, write K/V at response ``slot``, sample, record,
        advance. ``slots``: response slots the SDPA path reads (the Triton path reads the filled ones).

        Only fixed-shape tensor ops on ``st``'s buffers: capturable as a CUDA graph.
        """
        tok, pos = st.tok[:b], st.pos[:b]
        cos, sin = self._rope(pos[:, None, None])                                 # (b, 1, 1, D)
        rlen = st.slot + 1  # response slots filled once this step has written its own
        kind = self._attention_kind()
        splits = self.attention_splits or default_splits(b, self.model.config.num_attention_heads)
        nruns = self._runs_for(b)
        runs = (st.runs[0, :nruns], st.runs[1, :nruns]) if nruns else None

        def attend(i, q, k, v):
            if kind == "triton":  # the kernel writes this step's K/V at slot rlen - 1 itself
                return triton_decode_attention(q, st.pk[i], st.pv[i], st.rk[i], st.rv[i], st.grp, st.start, st.plen,
                                               rlen, k_new=k, v_new=v, live=st.live, splits=splits, runs=runs,
                                               run_rows=self._run_rows(), cache_rows=st.crow)
            crow = st.crow[:b]
            st.rk[i][crow, :, st.slot] = k[:, :, 0]  # (b, heads, head_dim) at (cache row, slot)
            st.rv[i][crow, :, st.slot] = v[:, :, 0]
            return reference_decode_attention(q, st.pk[i], st.pv[i], st.rk[i], st.rv[i], st.grp, st.start, st.plen, rlen,
                                              st.prompt_slots_cap, slots, live=st.live, cache_rows=st.crow)

        x = self.model.model.embed_tokens(tok)[:, None]
        compiled = self._step_compiled()
        h = (self._layers_compiled if compiled else self._layers)(x, cos, sin, attend)
        logits = self.model.lm_head(h[:, 0])
        tokens, lp = self._sample(st, logits, b, mode, compiled)
        rid = st.row_id[:b]
        col = st.step.expand(b)
        st.out_tok.index_put_((rid, col), tokens)
        st.out_lp.index_put_((rid, col), lp)
        st.tok[:b].copy_(tokens)
        st.pos[:b].add_(1)
        st.slot.add_(1)
        st.step.add_(1)

    # ------------------------------------------------------------------ graphs
    def _step_key(self, b: int, slots: int, mode: str) -> tuple:
        """What a captured step depends on besides the buffers: the bucket, the SDPA path's slots, the
        sampling mode, and the cascade's run table length and rows per run (both baked into the graph)."""
        nruns = self._runs_for(b)
        return b, slots, mode, nruns, self._run_rows() if nruns else 0

    def _run_step(self, st: _State, b: int, slots: int, mode: str):
        key = self._step_key(b, slots, mode)
        if key[3]:
            self.stats["cascade_steps"] += 1
        if not self._graphs_enabled():
            self._decode_step(st, b, slots, mode)
            return
        graph = self._graphs.get(key)
        if graph is None:
            if self._param_signature() != self._captured_signature:
                self._drop_graphs()
            graph = self._capture(st, b, slots, mode)
            self._graphs[key] = graph
            self._captured_signature = self._param_signature()
        graph.replay()

    def _capture(self, st: _State, b: int, slots: int, mode: str):
        t0 = time.perf_counter()
        saved = [t.clone() for t in (st.tok, st.pos, st.slot, st.step)]
        # The warm-up runs the step for real (it writes K/V at the current slot and one output
        # column); the counters are restored after, and the real replay rewrites the same places.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._decode_step(st, b, slots, mode)
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip((st.tok, st.pos, st.slot, st.step), saved):
            t.copy_(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Graphs share one pool: each writes its results into _State's buffers, so nothing a graph
        # allocates is alive after its replay.
        with torch.cuda.graph(graph, pool=self._pool):
            self._decode_step(st, b, slots, mode)
        for t, s in zip((st.tok, st.pos, st.slot, st.step), saved):
            t.copy_(s)
        torch.cuda.synchronize()
        self.stats["graphs_captured"] += 1
        self.stats["capture_time"] += time.perf_counter() - t0
        return graph

    def _run_rows(self) -> int:
        """Rows one cascade program takes (a power of two, at least 16 for the GPU's matrix units)."""
        n = self._chunk_shape[1]
        return min(32, max(16, 1 << (n - 1).bit_length()))

    def _runs_for(self, b: int) -> int:
        """Run-table entries the attention of batch bucket ``b`` reads: 0 (no cascade) unless the chunk
        has several samples per prompt, the path is Triton's and ``b >= cascade_min_rows``."""
        prompts, n = self._chunk_shape
        if n < 2 or self.cascade_min_rows is None or b < self.cascade_min_rows or self._attention_kind() != "triton":
            return 0
        return min(b, prompts * -(-n // self._run_rows()))

    def _set_runs(self, st: _State, groups: list[int], live: list[bool]) -> None:
        """Write the runs of batch rows sharing a prompt (``groups[i]``: batch row i's prompt) to the device."""
        if not self._runs_for(self.max_batch_size):
            return
        first, count = prompt_runs(groups, live, self._run_rows())
        pad = [0] * (st.rows_cap - len(first))
        st.runs.copy_(self._host_to_device([first + pad, count + pad], torch.int32), non_blocking=True)

    def _bucket(self, rows: int) -> int:
        for b in self.batch_buckets:
            if b >= rows:
                return b
        return rows

    def _slots_for(self, filled: int, cap: int) -> int:
        lb = self.length_bucket
        return min(cap, -(-filled // lb) * lb)

    # ------------------------------------------------------------------ one chunk
    @torch.inference_mode()
    def _generate_chunk(self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator,
                        limits: list[int] | None = None) -> list[list[Completion]]:
        tok, device, n = self.tokenizer, self.device, params.n
        P, L = len(prompt_ids), max(len(p) for p in prompt_ids)
        R, T = P * n, params.max_new_tokens
        lb = self.length_bucket
        st = self._ensure_state(self._bucket(R), P, -(-L // lb) * lb, -(-T // lb) * lb, T)
        self._chunk_shape = (P, n)
        if st.wqkv:
            self._refresh_stacked(st)
        mode = "greedy" if params.temperature == 0 else ("top_p" if params.top_p < 1.0 else "sample")
        # The Triton kernel reads the filled length on the device, so one graph serves every length.
        fixed_slots = st.slots_cap if self._attention_kind() == "triton" else None
        st.temperature.fill_(params.temperature if params.temperature > 0 else 1.0)
        st.top_p.fill_(params.top_p)

        input_ids = torch.full((P, L), tok.pad_token_id, dtype=torch.long)
        for r, ids in enumerate(prompt_ids):
            input_ids[r, L - len(ids):] = torch.tensor(ids)
        starts = torch.tensor([L - len(ids) for ids in prompt_ids], dtype=torch.long)
        input_ids, starts = input_ids.to(device), starts.to(device)

        # Prefill in slices of whole prompts under a token budget; K/V go straight to the rows.
        per = max(1, self.prefill_tokens // L)
        logits = []
        for a in range(0, P, per):
            sub = slice(a, min(P, a + per))
            logits.append(self._prefill(st, a, input_ids[sub], starts[sub]))
        logits = torch.cat(logits).repeat_interleave(n, dim=0)

        # Batch rows [R, b) are fillers: they read prompt 0 and write to the scratch output row.
        b = self._bucket(R)
        rows = torch.arange(b, device=device)
        st.row_id[:b].copy_(torch.where(rows < R, rows, torch.full_like(rows, st.rows_cap)))
        st.crow[:b].copy_(rows)
        st.live[:b].copy_(rows < R)
        st.grp[:b].copy_(torch.where(rows < R, rows // n, torch.zeros_like(rows)))
        st.start[:b].zero_()
        st.start[:R].copy_(starts.repeat_interleave(n))
        lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long, device=device).repeat_interleave(n)
        st.pos[:b].zero_()
        st.pos[:R].copy_(lengths)
        st.plen.fill_(L)
        self._set_runs(st, [r // n for r in range(R)], [True] * R)
        st.slot.zero_()
        st.step.zero_()

        # Step 0 samples from the prefill logits, eagerly; every later step is _decode_step.
        if mode != "greedy":
            st.noise[:R].exponential_(generator=generator)
        first, first_lp = self._sample(st, logits, R, mode, self._step_compiled())
        st.out_tok[:R, 0] = first
        st.out_lp[:R, 0] = first_lp
        st.tok[:b].fill_(tok.pad_token_id)
        st.tok[:R].copy_(first)
        st.step.fill_(1)

        stops = tuple(s for s in params.stop if s)
        window = _stop_window_tokens(stops)
        eos_ids = set() if getattr(params, "ignore_eos", False) else self.eos_ids
        batch_rows = list(range(R))     # global row of each batch row [0, len)
        generated: list[list[int]] = [[] for _ in range(R)]
        n_done = [0] * R                # tokens of the row already examined
        finish: list[str | None] = [None] * R
        stop_hit = [False] * R
        end = [T] * R                   # tokens kept
        limit = list(limits) if limits is not None else [T] * R
        if len(limit) != R or min(limit) < 1:
            raise ValueError("row_max_new_tokens needs n limits >= 1 for every prompt")
        live_rows = R                   # batch rows whose live flag on the device is 1

        def fetch(upto: int):
            """Start copying the sampled tokens [lo, upto) to the host, lo being the first token some
            unfinished row has not examined; returns the pending read (None when every row is done)."""
            live = [g for g in batch_rows if finish[g] is None]
            if not live:
                return None
            lo = min(n_done[g] for g in live)
            cols = st.out_tok[:R, lo:upto]
            if cols.device.type != "cuda":
                return lo, cols.clone(), None
            host = torch.empty(cols.shape, dtype=cols.dtype, pin_memory=True)
            host.copy_(cols, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return lo, host, done

        def examine(pending):
            """Read a fetched span of new tokens of the unfinished rows; apply EOS, stop strings and the
            length limit exactly as checking after every token would."""
            if pending is None:
                return
            lo, host, done = pending
            if done is not None:
                done.synchronize()
            self.stats["host_syncs"] += 1
            live = [g for g in batch_rows if finish[g] is None]
            if not live:
                return
            upto = lo + host.shape[1]
            host = host.tolist()
            spans = []  # (row, first new token, end of the tokens to stop-check)
            for g in live:
                a = n_done[g]
                new = host[g][a - lo:min(limit[g], upto) - lo]
                cut = next((a + j for j, t in enumerate(new) if t in eos_ids), None)
                generated[g].extend(new if cut is None else new[: cut - a + 1])
                n_done[g] = a + len(new)
                if cut is not None:
                    finish[g], end[g] = "stop", cut + 1
                elif n_done[g] >= limit[g]:
                    finish[g], end[g] = "length", limit[g]
                body_end = n_done[g] if cut is None else cut
                if stops and body_end > a:
                    spans.append((g, a, body_end))
            if not spans:
                return
            # One batched decode of each row's new span (with the window before it) finds the rows
            # that may hold a stop; only those are scanned token by token to find where it completed.
            texts = tok.batch_decode([generated[g][max(0, a - window + 1):e] for g, a, e in spans],
                                     skip_special_tokens=True)
            for (g, a, e), text in zip(spans, texts):
                if find_stop(text, stops) is None:
                    continue
                seq = generated[g]
                tails = tok.batch_decode([seq[max(0, s + 1 - window):s + 1] for s in range(a, e)],
                                         skip_special_tokens=True)
                for s, tail in zip(range(a, e), tails):
                    if find_stop(tail, stops) is not None:
                        finish[g], stop_hit[g], end[g] = "stop", True, s + 1
                        break

        # Host checks run one sync period behind the device: at each sync point the tokens so far start
        # copying to the host, and the copy started at the previous sync point is examined while the
        # device runs the next steps (host work and device work overlap instead of taking turns). A row
        # that finished meanwhile decodes a few steps more, which its result never includes.
        step = 1
        filled = 0  # response slots holding K/V
        pending = None
        while True:
            if step >= T or (step % self.sync_every == 0):
                latest = fetch(step)
                examine(pending)
                pending = latest
                if step >= T:
                    examine(pending)
                if all(finish[g] is not None for g in batch_rows) or step >= T:
                    break
                alive = [i for i, g in enumerate(batch_rows) if finish[g] is None]
                nb = self._bucket(len(alive))
                if nb < b:
                    self._compact(st, alive, b, nb)
                    batch_rows = [batch_rows[i] for i in alive]
                    live_rows = len(batch_rows)
                    b = nb
                    self._set_runs(st, [g // n for g in batch_rows], [True] * live_rows)
                elif len(alive) < live_rows:  # rows finished: the attention skips them from now on
                    self.stats["rows_flagged"] += live_rows - len(alive)
                    live_rows = len(alive)
                    flags = [finish[g] is None for g in batch_rows]
                    st.live[:len(flags)].copy_(self._host_to_device(flags, torch.int32), non_blocking=True)
                    self._set_runs(st, [g // n for g in batch_rows], flags)
            if mode != "greedy":
                st.noise[:b].exponential_(generator=generator)
            self._run_step(st, b, fixed_slots or self._slots_for(filled + 1, st.slots_cap), mode)
            filled += 1
            step += 1

        lp_host = st.out_lp[:R, :T].cpu()
        kept = [generated[g][: end[g]] for g in range(R)]
        texts = tok.batch_decode([ids[:-1] if ids and ids[-1] in eos_ids else ids for ids in kept],
                                 skip_special_tokens=True)
        completions: list[list[Completion]] = [[] for _ in range(P)]
        for g, (ids, text) in enumerate(zip(kept, texts)):
            if stop_hit[g]:
                text, _ = truncate_at_stop(text, stops, params.include_stop_str_in_output)
            completions[g // n].append(Completion(text=text, token_ids=ids, finish_reason=finish[g] or "length",
                                                  logprobs=lp_host[g, : len(ids)].tolist()))
        return completions

    def _host_to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor ready for a non-blocking copy to the device: in pinned memory on CUDA
        (a copy from pageable memory would wait for every queued step), plain elsewhere."""
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _compact(self, st: _State, alive: list[int], b: int, nb: int):
        """Move the alive batch rows to [0, len(alive)) and fill the rest of the new bucket with scratch rows.

        The K/V caches stay where they are: a row takes its cache row along (``crow``), and the scratch
        rows get cache rows of finished ones (they write there, and nothing reads them)."""
        self.stats["compactions"] += 1
        kept = set(alive)
        order = alive + [i for i in range(b) if i not in kept]  # every batch row once, the alive ones first
        idx = self._host_to_device(order, torch.long).to(st.tok.device, non_blocking=True)
        na = len(alive)
        for t in (st.tok, st.pos, st.grp, st.start, st.row_id, st.crow):
            t[:b].copy_(t[idx])
        st.live[:na].fill_(1)
        st.live[na:nb].zero_()
        st.row_id[na:nb].fill_(st.rows_cap)
        st.grp[na:nb].zero_()
        st.start[na:nb].zero_()
