"""``FastHFEngine``: the chunk loop (prefill, decode steps, host checks, retiring rows) over the static
cache (``state``), the family-parametrised step (``step``, ``families``), the CUDA graphs (``graphs``)
and the host-side stop handling (``stops``). The package docstring describes the design."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from rlvr.engines.base import Completion, SamplingParams
from rlvr.engines.fast import step as S
from rlvr.engines.fast.families import layer_weights, layout_of
from rlvr.engines.fast.graphs import StepGraphs
from rlvr.engines.fast.kernels.decode_attention import (
    default_splits,
    prompt_runs,
    reference_decode_attention,
    triton_available,
    triton_decode_attention,
)
from rlvr.engines.fast.kernels.sampling import CounterNoise, exponential_noise, triton_sample
from rlvr.engines.fast.prefix import KVBlock, PrefixStore, Span
from rlvr.engines.fast.state import State, allocate, ensure_noise, refresh_stacked
from rlvr.engines.fast.stops import RowChecks
from rlvr.engines.sampling import eos_token_ids, generate_in_chunks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The response K/V of finished rows copied out of the cache (``continuing``): per layer, K and V of
# shape (rows, kv_heads, slots, head_dim).
HeldBatch = tuple[list[torch.Tensor], list[torch.Tensor]]

DEFAULT_BATCH_BUCKETS = (256, 192, 128, 96, 64, 48, 32, 24, 16, 8, 4, 2, 1)


class FastHFEngine:
    """Static-cache, CUDA-graph sampling with an OLMo-2, Llama, Qwen2 or Qwen3 causal LM in this process.

    Holds a reference to ``model`` (no copy): trainer updates are visible at once, since graphs read
    the parameters in place (an optimizer step updates them in place; replacing a parameter tensor
    needs ``sync_weights``, which drops the graphs). Any other model raises a one-line ``ValueError``
    naming the supported families and the ``hf`` engine as the fallback.

    ``max_batch_size`` bounds the rows decoded together (prompts × n); ``batch_buckets`` are the
    batch sizes graphs are captured for; ``length_bucket`` rounds the attended cache length;
    ``sync_every`` is how many steps run between host checks of EOS / stop strings (the default was the
    faster of those timed: finished rows are flagged and retired sooner). ``attention``
    is ``"triton"`` (one kernel over the shared prompt and response caches, and greedy or temperature
    sampling in one pass over the logits; CUDA, or the Triton interpreter), ``"sdpa"`` (gather each
    row's prompt K/V and call SDPA, sample with ``sample_math``; any device) or ``"auto"``
    (default: ``"triton"`` on CUDA when Triton is installed, else ``"sdpa"``); ``fused_norms``
    computes each RMS norm with one ``F.rms_norm`` on the same float32 values (fewer kernels per step)
    instead of transformers' elementwise operations. Both defaults were the fastest on an H200
    (docs/benchmarks.md). ``compile_step`` runs the decode step's per-layer pieces and ``sample_math``
    through ``torch.compile`` (fewer, fused kernels per step; compiled once, on the first call);
    ``None`` means on for CUDA with CUDA graphs, off elsewhere. It applies to SiLU MLPs (every
    supported family's); other settings run eagerly.
    ``release_memory`` frees the static KV cache and the graphs after every ``generate`` call, so that a
    training step on the same GPU can use that memory; each call then allocates the cache and captures
    its graphs again (the compiled step is kept), which costs time (docs/benchmarks.md).
    ``fuse_projections`` (compiled step only) stacks each layer's q/k/v weights (and biases, where the
    family has them) into one matrix and its gate/up weights into another, so a step runs two large
    matmuls instead of five small ones; the stacked copies (about half the model's weights) are
    refreshed from the model at the start of every chunk, so in-place weight updates between calls are
    seen. ``attention_splits`` (Triton path) fixes how many programs share a row's slots; ``None`` picks
    ``default_splits`` per batch bucket.
    ``cascade_min_rows`` (Triton path, ``n >= 2``): batch buckets of at least this many rows read each
    group's shared prompt once per step for all of the group's rows (one program per run of rows with
    one prompt, then each row reads only its own response slots); smaller buckets, where few rows share
    a prompt, read it per row. ``None`` turns this off.
    ``continuing()`` is the context a multi-turn rollout runs in: the engine keeps every row's context
    with its completion and prefills a later turn only past what it shares with a kept one (the
    package docstring says what is reused and what is prefilled again).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int = 256,
        batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        length_bucket: int = 128,
        sync_every: int = 4,
        use_cuda_graphs: bool | None = None,
        mask_unused_vocab: bool = True,
        prefill_tokens: int = 32768,
        attention: str = "auto",
        fused_norms: bool = True,
        compile_step: bool | None = None,
        release_memory: bool = False,
        fuse_projections: bool = True,
        attention_splits: int | None = None,
        cascade_min_rows: int | None = 64,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token = tokenizer.eos_token")
        self.layout = layout_of(model)
        if max_batch_size < 1 or length_bucket < 1 or sync_every < 1:
            raise ValueError("max_batch_size, length_bucket and sync_every must all be >= 1")
        if cascade_min_rows is not None and cascade_min_rows < 1:
            raise ValueError(
                f"cascade_min_rows must be >= 1, or None to turn cascade attention off; got {cascade_min_rows}"
            )
        if attention_splits is not None and (attention_splits < 1 or attention_splits & (attention_splits - 1)):
            raise ValueError(f"attention_splits must be a power of two >= 1 or None, got {attention_splits}")
        if attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'sdpa', got {attention!r}")
        if attention == "triton" and not triton_available():
            raise ValueError(
                "attention='triton' needs the triton package (it ships with CUDA builds of torch); use attention='sdpa'"
            )
        # A transformers causal LM of a supported family: its config and submodules are read by name.
        self.model: Any = model
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
        self.stats = {
            "tokens": 0,
            "time": 0.0,
            "graphs_captured": 0,
            "capture_time": 0.0,
            "host_syncs": 0,
            "compactions": 0,
            "rows_flagged": 0,
            "cascade_steps": 0,
            "prefilled_tokens": 0,
            "reused_tokens": 0,
        }
        self._prefixes: PrefixStore | None = None
        self._state: State | None = None
        self._graphs = StepGraphs(self.stats)
        self._weights = layer_weights(model, self.layout)

    # ------------------------------------------------------------------ engine interface
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sync_weights(self, model: torch.nn.Module) -> dict:
        if model is not self.model:
            self.layout = layout_of(model)
            self.model = model
            self._state = None  # the cache's shape may differ
        self._weights = layer_weights(self.model, self.layout)
        if self._prefixes is not None:  # kept K/V were computed by the old weights
            self._prefixes = PrefixStore()
        # Optimizers update parameters in place, so captured graphs stay valid; only new parameter
        # tensors (a new model, a reloaded state) make them read stale memory.
        if self._graphs.stale(self._param_signature()):
            self._graphs.drop()
        return {"time/sync": 0.0}

    def close(self) -> None:
        self._graphs.drop()
        self._state = None

    @contextlib.contextmanager
    def continuing(self) -> Iterator[PrefixStore]:
        """Within this context the engine keeps the K/V of every prompt it prefills (``prefix.PrefixStore``)
        and prefills a later prompt only past the longest start it shares with a kept one: a conversation's
        next turn re-reads its earlier context from the cache. The weights must not change inside (an
        in-place optimizer step is invisible to the engine); ``sync_weights`` empties the store. On leaving,
        the kept K/V are freed. ``stats["prefilled_tokens"]`` and ``stats["reused_tokens"]`` count the
        prompt tokens computed and those taken from the store."""
        self._prefixes = store = PrefixStore()
        try:
            yield store
        finally:
            self._prefixes = None

    def _param_signature(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _graphs_enabled(self) -> bool:
        if self.use_cuda_graphs is None:
            return self.device.type == "cuda"
        return bool(self.use_cuda_graphs) and self.device.type == "cuda"

    def generate(
        self, prompts: list[str], params: SamplingParams, *, row_max_new_tokens: list[list[int]] | None = None
    ) -> list[list[Completion]]:
        """``row_max_new_tokens[i][j]`` (optional, for benchmarks) caps sample j of prompt i below
        ``params.max_new_tokens``: that row finishes with reason ``"length"`` there, as if it had
        reached its own limit, so a batch can retire rows at chosen lengths."""
        if prompts and params.n > self.max_batch_size:
            raise ValueError(f"n={params.n} exceeds max_batch_size={self.max_batch_size}; raise max_batch_size")

        def run_chunk(
            idx: list[int], prompt_ids: list[list[int]], generator: torch.Generator
        ) -> list[list[Completion]]:
            limits = None
            if row_max_new_tokens is not None:
                limits = [min(int(x), params.max_new_tokens) for i in idx for x in row_max_new_tokens[i]]
            return self._generate_chunk(prompt_ids, params, generator, limits)

        try:
            return generate_in_chunks(self, prompts, params, run_chunk)
        finally:
            if self._prefixes is not None:
                self._prefixes.end_call()
            if self.release_memory:
                self.close()  # the trainer's step can use the cache's memory; the next call re-captures

    # ------------------------------------------------------------------ buffers
    def _ensure_state(self, rows: int, groups: int, prompt_slots: int, slots: int, steps: int) -> State:
        st = self._state
        model, device = self.model, self.device
        dtype = model.lm_head.weight.dtype
        need: tuple[int, ...] = (rows, groups, prompt_slots, slots, steps)
        if st is not None:
            have = st.caps
            if all(h >= n for h, n in zip(have, need)) and st.rk[0].dtype == dtype and st.rk[0].device == device:
                return st
            need = tuple(max(h, n) for h, n in zip(have, need))  # grow to cover the old and the new request
            del st  # let the old buffers go before the new ones are allocated
        rows, groups, prompt_slots, slots, steps = need
        self._graphs.drop()
        self._state = None
        self._state = allocate(
            self.layout,
            self._weights,
            rows=rows,
            groups=groups,
            prompt_slots=prompt_slots,
            slots=slots,
            steps=steps,
            vocab=model.lm_head.weight.shape[0],
            tokenizer_vocab=len(self.tokenizer),
            mask_unused_vocab=self.mask_unused_vocab,
            dtype=dtype,
            device=device,
            stacked=self._stacked_weights(),
        )
        return self._state

    def _stacked_weights(self) -> bool:
        """Whether decode steps use stacked q/k/v and gate/up weights (``fuse_projections``, compiled step)."""
        return self.fuse_projections and self._step_compiled()

    # ------------------------------------------------------------------ the model, by hand
    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rot = self.model.model.rotary_emb
        return S.rope_tables(
            pos,
            rot.inv_freq,
            getattr(rot, "attention_scaling", 1.0),
            self.model.model.embed_tokens.weight.dtype,
            self.layout.family.float32_scale,
        )

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Run every decoder layer on x (B, Q, hidden); ``attend(i, q, k, v)`` gets q (B, heads, Q, D), k and
        v (B, kv_heads, Q, D) and returns (B, heads, Q, D). The compiled pieces when the step is compiled
        (always the fused norms), else the same functions eagerly."""
        layout, family = self.layout, self.layout.family
        compiled = self._step_compiled()
        pre = S.compiled(S.pre_attention, family.name) if compiled else S.pre_attention
        post = S.compiled(S.post_attention, family.name) if compiled else S.post_attention
        fused = compiled or self.fused_norms
        common: dict[str, Any] = dict(
            eps=layout.eps,
            pre_norm=family.norms == "pre",
            float32_scale=family.float32_scale,
            fused=fused,
        )
        st = self._state
        # The state whose stacked weights the layers use, or None to use each layer's own tensors.
        stacked = st if st is not None and st.wqkv else None
        for i, w in enumerate(self._weights):
            if stacked is not None:
                wqkv, bqkv = stacked.wqkv[i], stacked.bqkv[i]
                wgate_up, bgate_up = stacked.wgate_up[i], stacked.bgate_up[i]
            else:
                wqkv, bqkv = (w.wq, w.wk, w.wv), (w.bq, w.bk, w.bv)
                wgate_up, bgate_up = (w.w_gate, w.w_up), (w.b_gate, w.b_up)
            q, k, v = pre(
                x,
                w.norm1,
                wqkv,
                bqkv,
                w.q_norm,
                w.k_norm,
                cos,
                sin,
                heads=layout.heads,
                kv_heads=layout.kv_heads,
                head_dim=layout.head_dim,
                qk_norm=family.qk_norm,
                **common,
            )
            o = attend(i, q, k, v)
            # The compiled step takes F.silu itself: each layer's activation module is its own object, and
            # a compiled function guards on the identity of the callables it is handed.
            x = post(
                x,
                o,
                w.wo,
                w.bo,
                w.norm1,
                w.norm2,
                wgate_up,
                bgate_up,
                w.w_down,
                w.b_down,
                F.silu if compiled else w.act,
                **common,
            )
        norm = S.rms if fused else S.rms_unfused
        return norm(x, self.model.model.norm.weight, layout.eps, family.float32_scale)

    def _prefill(
        self, st: State, group0: int, input_ids: torch.Tensor, starts: torch.Tensor, first: torch.Tensor, total: int
    ) -> torch.Tensor:
        """Prefill the last S columns (``input_ids`` (P, S)) of left-padded prompts ``total`` slots long in
        prompt-cache entries [group0, group0 + P): row p's tokens fill slots [starts[p], total), and those
        before first[p] already hold K/V (a kept prefix copied in), which the new tokens attend to and
        which are not computed again. Returns the last position's logits (P, vocab)."""
        P, S = input_ids.shape
        L = total
        device = input_ids.device
        layout = self.layout
        cols = torch.arange(L - S, L, device=device)  # the query slots
        keys = torch.arange(L, device=device)
        positions = (cols[None, :] - starts[:, None]).clamp(min=0)
        cos, sin = self._rope(positions[:, None])  # broadcast over heads
        computed = (cols[None, :] >= first[:, None])[:, None, :, None]  # (P, 1, S, 1)
        key_ok = keys[None, :] >= starts[:, None]  # (P, L)
        causal = keys[None, :] <= cols[:, None]  # (S, L) [query, key]
        # A padding query attends to itself so that no row of the softmax is empty (no NaN in K/V).
        mask = causal[None] & (key_ok[:, None, :] | (keys[None, :] == cols[:, None])[None])
        mask = mask[:, None]  # (P, 1, S, L)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pk, pv = st.pk[i][group0 : group0 + P, :, :L], st.pv[i][group0 : group0 + P, :, :L]
            # Only the computed tokens' K/V are written: a kept prefix in the window stays as it was.
            pk[:, :, L - S :] = torch.where(computed, k, pk[:, :, L - S :])
            pv[:, :, L - S :] = torch.where(computed, v, pv[:, :, L - S :])
            k, v = pk, pv
            if layout.groups > 1:  # each key/value head serves ``groups`` query heads (grouped-query attention)
                shape = (P, layout.kv_heads, layout.groups, L, layout.head_dim)
                k = k[:, :, None].expand(shape).reshape(P, layout.heads, L, layout.head_dim)
                v = v[:, :, None].expand(shape).reshape(P, layout.heads, L, layout.head_dim)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        x = self.model.model.embed_tokens(input_ids)
        h = self._layers(x, cos, sin, attend)
        return self.model.lm_head(h[:, -1])

    def _reuse(self, st: State, prompt_ids: list[list[int]], L: int) -> list[int]:
        """Per prompt of a chunk (entry p of the prompt cache, right-aligned in ``L`` slots), the leading
        tokens whose K/V come from the kept contexts (``continuing``), copied into place (one gather and
        one scatter a layer per block they come from); 0 outside it."""
        store = self._prefixes
        if store is None:
            return [0] * len(prompt_ids)
        reused = []
        moves: dict[int, tuple[KVBlock, list[int], list[int], list[int]]] = {}  # block -> its tokens, rows, slots
        for p, ids in enumerate(prompt_ids):
            kept, n = store.find(ids)
            reused.append(n)
            slot, left = L - len(ids), n
            for block, first, count in kept.spans if kept is not None else []:
                take = min(count, left)
                if take <= 0:
                    break
                _, src, rows, slots = moves.setdefault(id(block), (block, [], [], []))
                src.extend(range(first, first + take))
                rows.extend([p] * take)
                slots.extend(range(slot, slot + take))
                slot, left = slot + take, left - take
        for block, src, rows, slots in moves.values():
            src_t, rows_t, slots_t = self._index(src), self._index(rows), self._index(slots)
            for pk, pv, bk, bv in zip(st.pk, st.pv, block.k, block.v):
                pk[rows_t, :, slots_t] = bk.index_select(0, src_t)
                pv[rows_t, :, slots_t] = bv.index_select(0, src_t)
        return reused

    def _hold(self, st: State, rows: list[int], held: dict, filled: int) -> None:
        """Copy the response K/V of finished ``rows`` (global rows, each in its own cache row) out of the
        cache, before a compaction hands their cache rows to fillers (``continuing``): one gather a layer
        for all the rows not held yet, slots [0, filled) (the K/V of the tokens each row was fed)."""
        new = [g for g in rows if g not in held]
        if not new:
            return
        index = self._index(new)
        batch = (  # per layer (rows, kv_heads, filled, head_dim)
            [rk[:, :, :filled].index_select(0, index) for rk in st.rk],
            [rv[:, :, :filled].index_select(0, index) for rv in st.rv],
        )
        for j, g in enumerate(new):
            held[g] = (batch, j)

    def _keep(self, st: State, prompt_ids: list[list[int]], L: int, out: list[list[Completion]], held: dict) -> None:
        """Keep each row's context as it stands after its completion (``continuing``): the prompt's K/V,
        packed once for the prompt's samples, then those of the completion's tokens but the last (which
        was sampled, never fed), packed per batch of rows held together."""
        store = cast(PrefixStore, self._prefixes)
        n = len(out[0]) if out else 1
        first: list[int] = []
        rows: list[int] = []
        slots: list[int] = []
        for p, ids in enumerate(prompt_ids):
            first.append(len(rows))
            rows.extend([p] * len(ids))
            slots.extend(range(L - len(ids), L))
        rows_t, slots_t = self._index(rows), self._index(slots)
        prompts = KVBlock([pk[rows_t, :, slots_t] for pk in st.pk], [pv[rows_t, :, slots_t] for pv in st.pv])

        fed = {p * n + j: max(len(c.token_ids) - 1, 0) for p, group in enumerate(out) for j, c in enumerate(group)}
        packs: dict[int, tuple[HeldBatch, list[int], list[int], list[int]]] = {}  # batch -> its rows, slots, members
        for g, count in fed.items():
            batch, j = held[g]
            _, brows, bslots, members = packs.setdefault(id(batch), (batch, [], [], []))
            members.append(g)
            brows.extend([j] * count)
            bslots.extend(range(count))
        span: dict[int, Span] = {}
        for batch, brows, bslots, members in packs.values():
            r, s = self._index(brows), self._index(bslots)
            block = KVBlock([k[r, :, s] for k in batch[0]], [v[r, :, s] for v in batch[1]])
            at = 0
            for g in members:
                span[g] = (block, at, fed[g])
                at += fed[g]
        for p, ids in enumerate(prompt_ids):
            for j, c in enumerate(out[p]):
                g = p * n + j
                store.add(ids + c.token_ids[: fed[g]], [(prompts, first[p], len(ids)), span[g]])

    def _sample(
        self, st: State, logits: torch.Tensor, b: int, mode: str, compiled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their temperature-1 log-probs for logits (b, vocab). With counter noise each row's
        Exp(1) draws come from (the chunk's seed, its output row, the step); otherwise ``noise[:b]`` must
        hold them. The Triton path reads the logits once and makes the noise as it goes
        (``triton_sample``); top-p sorts, in ``sample_math``, over the noise written out."""
        counter = CounterNoise(st.seed, st.step, st.row_id[:b]) if self._counter_noise() else None
        if mode != "top_p" and self._attention_kind() == "triton":
            return triton_sample(logits, st.vocab_bias, st.temperature, None if mode == "greedy" else counter)
        if counter is not None and mode != "greedy":
            exponential_noise(counter, logits.shape[1], out=st.noise[:b])
        fn = S.compiled(S.sample_math) if compiled else S.sample_math
        return fn(logits, st.vocab_bias, st.temperature, st.top_p, st.noise[:b], mode)

    def _ensure_noise(self, st: State, mode: str) -> None:
        """Give the state its noise buffer where ``_sample`` takes ``sample_math`` (top-p, the SDPA path),
        which reads one; the Triton kernel makes its own noise and needs none."""
        if mode == "top_p" or self._attention_kind() != "triton":
            ensure_noise(st)

    def _triton_runs(self) -> bool:
        """Whether Triton kernels can run on this engine's device: CUDA, or Triton's interpreter."""
        return triton_available() and (self.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def _counter_noise(self) -> bool:
        """Whether sampling noise is counter-based (Triton's Philox, where Triton runs) rather than drawn
        step by step from the caller's generator into ``noise``."""
        return self._triton_runs()

    def _step_compiled(self) -> bool:
        """Whether decode steps run the compiled pieces (``compile_step``, resolved for this model)."""
        if self.compile_step is None:
            return self._graphs_enabled() and self._compilable() is None
        return bool(self.compile_step)

    def _compilable(self) -> str | None:
        """None when the compiled pieces apply to the model, else why not."""
        act = getattr(self.model.config, "hidden_act", None)
        if act != "silu":
            return f"hidden_act {act!r} (the compiled step assumes silu)"
        return None

    def _attention_kind(self) -> str:
        """``"triton"`` or ``"sdpa"``: ``attention`` resolved for this engine's device."""
        if self.attention == "auto":
            return "triton" if self.device.type == "cuda" and triton_available() else "sdpa"
        if self.attention == "triton" and not self._triton_runs():
            raise ValueError(
                f"attention='triton' runs on CUDA (or under TRITON_INTERPRET=1); the model is on "
                f"{self.device}: use attention='sdpa'"
            )
        return self.attention

    def _decode_step(self, st: State, b: int, slots: int, mode: str) -> None:
        """One step for batch rows [0, b): feed ``tok``, write K/V at response ``slot``, sample, record,
        advance. ``slots``: response slots the SDPA path reads (the Triton path reads the filled ones).

        Only fixed-shape tensor ops on ``st``'s buffers: capturable as a CUDA graph.
        """
        tok, pos = st.tok[:b], st.pos[:b]
        cos, sin = self._rope(pos[:, None, None])  # (b, 1, 1, D)
        rlen = st.slot + 1  # response slots filled once this step has written its own
        kind = self._attention_kind()

        if kind == "triton":
            # With grouped-query attention the kernel takes each key/value head's query heads together
            # (one program per row and key/value head), so each cache is read once per step.
            splits = self.attention_splits or default_splits(b, self.layout.kv_heads)
            nruns = self._runs_for(b)
            runs = (st.runs[0, :nruns], st.runs[1, :nruns]) if nruns else None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kind == "triton":  # the kernel writes this step's K/V at slot rlen - 1 itself
                return triton_decode_attention(
                    q,
                    st.pk[i],
                    st.pv[i],
                    st.rk[i],
                    st.rv[i],
                    st.grp,
                    st.start,
                    st.plen,
                    rlen,
                    k_new=k,
                    v_new=v,
                    live=st.live,
                    splits=splits,
                    runs=runs,
                    run_rows=self._run_queries(),
                    cache_rows=st.crow,
                )
            cache_rows = st.crow[:b]
            st.rk[i][cache_rows, :, st.slot] = k[:, :, 0]  # (b, kv_heads, head_dim) at (cache row, slot)
            st.rv[i][cache_rows, :, st.slot] = v[:, :, 0]
            return reference_decode_attention(
                q,
                st.pk[i],
                st.pv[i],
                st.rk[i],
                st.rv[i],
                st.grp,
                st.start,
                st.plen,
                rlen,
                st.prompt_slots_cap,
                slots,
                live=st.live,
                cache_rows=st.crow,
            )

        x = self.model.model.embed_tokens(tok)[:, None]
        h = self._layers(x, cos, sin, attend)
        logits = self.model.lm_head(h[:, 0])
        tokens, lp = self._sample(st, logits, b, mode, self._step_compiled())
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

    def _run_step(self, st: State, b: int, slots: int, mode: str) -> None:
        self._ensure_noise(st, mode)  # before any capture: a graph keeps the buffer's address
        key = self._step_key(b, slots, mode)
        if key[3]:
            self.stats["cascade_steps"] += 1
        if not self._graphs_enabled():
            self._decode_step(st, b, slots, mode)
            return
        self._graphs.replay(
            key,
            self._param_signature,
            lambda: self._decode_step(st, b, slots, mode),
            (st.tok, st.pos, st.slot, st.step),
        )

    def _run_rows(self) -> int:
        """Batch rows one cascade program takes: a power of two, whose queries (rows x query heads per
        key/value head) stay within 64 and fill at least 16 lanes of the GPU's matrix units."""
        n, groups = self._chunk_shape[1], self.layout.groups
        if groups == 1:
            return min(32, max(16, 1 << (n - 1).bit_length()))
        return max(1, min(1 << (n - 1).bit_length(), 64 // groups))

    def _run_queries(self) -> int:
        """Queries one cascade program takes (the kernel's ``run_rows``): the rows' query heads of one
        key/value head, rounded up to a power of two of at least 16."""
        return max(16, 1 << (self._run_rows() * self.layout.groups - 1).bit_length())

    def _runs_for(self, b: int) -> int:
        """Run-table entries the attention of batch bucket ``b`` reads: 0 (no cascade) unless the chunk
        has several samples per prompt, the path is Triton's and ``b >= cascade_min_rows``."""
        prompts, n = self._chunk_shape
        if n < 2 or self.cascade_min_rows is None or b < self.cascade_min_rows or self._attention_kind() != "triton":
            return 0
        return min(b, prompts * -(-n // self._run_rows()))

    def _set_runs(self, st: State, groups: list[int], live: list[bool]) -> None:
        """Write the runs of batch rows sharing a prompt (``groups[i]``: batch row i's prompt) to the device,
        (first batch row, row count) per run."""
        if not self._runs_for(self.max_batch_size):
            return
        first, count = prompt_runs(groups, live, self._run_rows())
        pad = [0] * (st.runs.shape[1] - len(first))
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
    def _generate_chunk(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator,
        limits: list[int] | None = None,
    ) -> list[list[Completion]]:
        tok, device, n = self.tokenizer, self.device, params.n
        P, L = len(prompt_ids), max(len(p) for p in prompt_ids)
        R, T = P * n, params.max_new_tokens
        lb = self.length_bucket
        self._weights = layer_weights(self.model, self.layout)  # the model's current parameter tensors
        st = self._ensure_state(self._bucket(R), P, -(-L // lb) * lb, -(-T // lb) * lb, T)
        self._chunk_shape = (P, n)
        if st.wqkv:
            refresh_stacked(st, self._weights)
        mode = "greedy" if params.temperature == 0 else ("top_p" if params.top_p < 1.0 else "sample")
        # The Triton kernel reads the filled length on the device, so one graph serves every length.
        fixed_slots = st.slots_cap if self._attention_kind() == "triton" else None
        st.temperature.fill_(params.temperature if params.temperature > 0 else 1.0)
        st.top_p.fill_(params.top_p)

        # Only the tokens past a kept prefix are prefilled: the last S slots hold every prompt's new tokens.
        reused = self._reuse(st, prompt_ids, L)
        S = max(len(ids) - kept for ids, kept in zip(prompt_ids, reused))
        input_ids = torch.full((P, S), tok.pad_token_id, dtype=torch.long)
        for r, (ids, kept) in enumerate(zip(prompt_ids, reused)):
            input_ids[r, S - (len(ids) - kept) :] = torch.tensor(ids[kept:])
        starts = torch.tensor([L - len(ids) for ids in prompt_ids], dtype=torch.long)
        first = starts + torch.tensor(reused, dtype=torch.long)
        input_ids, starts, first = input_ids.to(device), starts.to(device), first.to(device)
        self.stats["prefilled_tokens"] += sum(len(ids) for ids in prompt_ids) - sum(reused)
        self.stats["reused_tokens"] += sum(reused)

        # Prefill in slices of whole prompts under a token budget; K/V go straight to the rows.
        per = max(1, self.prefill_tokens // S)
        prefill_logits = []
        for a in range(0, P, per):
            sub = slice(a, min(P, a + per))
            prefill_logits.append(self._prefill(st, a, input_ids[sub], starts[sub], first[sub], L))
        logits = torch.cat(prefill_logits).repeat_interleave(n, dim=0)

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
        self._ensure_noise(st, mode)
        counter_noise = mode != "greedy" and self._counter_noise()
        if counter_noise:  # one seed a chunk; the steps' draws follow from it on the device
            st.seed.copy_(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        elif mode != "greedy":
            st.noise[:R].exponential_(generator=generator)
        first, first_lp = self._sample(st, logits, R, mode, self._step_compiled())
        st.out_tok[:R, 0] = first
        st.out_lp[:R, 0] = first_lp
        st.tok[:b].fill_(tok.pad_token_id)
        st.tok[:R].copy_(first)
        st.step.fill_(1)

        stops = tuple(s for s in params.stop if s)
        eos_ids = set() if getattr(params, "ignore_eos", False) else self.eos_ids
        checks = RowChecks(tok, R, T, stops, eos_ids, limits, self.stats)
        batch_rows = list(range(R))  # global row of each batch row [0, len)
        live_rows = R  # batch rows whose live flag on the device is 1

        # Host checks run one sync period behind the device: at each sync point the tokens so far start
        # copying to the host, and the copy started at the previous sync point is examined while the
        # device runs the next steps (host work and device work overlap instead of taking turns). A row
        # that finished meanwhile decodes a few steps more, which its result never includes.
        step = 1
        filled = 0  # response slots holding K/V
        pending = None
        finish = checks.finish
        held: dict[int, tuple[HeldBatch, int]] = {}  # ``continuing``: finished rows' K/V (a batch, the row in it)
        while True:
            if step >= T or (step % self.sync_every == 0):
                latest = checks.fetch(st.out_tok[:R], step)
                checks.examine(pending)
                pending = latest
                if step >= T:
                    checks.examine(pending)
                if self._prefixes is not None:
                    self._hold(st, [g for g in range(R) if finish[g] is not None], held, filled)
                if checks.all_finished() or step >= T:
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
                    st.live[: len(flags)].copy_(self._host_to_device(flags, torch.int32), non_blocking=True)
                    self._set_runs(st, [g // n for g in batch_rows], flags)
            if mode != "greedy" and not counter_noise:
                st.noise[:b].exponential_(generator=generator)
            self._run_step(st, b, fixed_slots or self._slots_for(filled + 1, st.slots_cap), mode)
            filled += 1
            step += 1

        out = checks.completions(st.out_lp[:R, :T].cpu(), n, params.include_stop_str_in_output)
        if self._prefixes is not None:
            self._hold(st, list(range(R)), held, filled)
            self._keep(st, prompt_ids, L, out, held)
        return out

    def _index(self, values: list[int]) -> torch.Tensor:
        """Host indices as an int64 tensor on the engine's device (an empty list too)."""
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _host_to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor ready for a non-blocking copy to the device: in pinned memory on CUDA
        (a copy from pageable memory would wait for every queued step), plain elsewhere."""
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _compact(self, st: State, alive: list[int], b: int, nb: int) -> None:
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
