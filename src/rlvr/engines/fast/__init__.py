"""Fast in-process sampling: a static KV cache and a CUDA-graph decode step, for OLMo-2, Llama (3.x,
including ``llama3`` rope scaling), Qwen2 / Qwen2.5 and Qwen3 models.

``FastHFEngine`` (engine name ``hf-fast``) has ``HFEngine``'s interface and samples from the same
distribution; it differs in how the work reaches the GPU:

* **Static KV cache, prompt stored once per group.** Two preallocated, zero-filled K and V buffers
  per layer: the prompt cache (prompts, kv heads, prompt slots, head_dim), which holds each prompt
  once however many samples it has, and the response cache (rows, kv heads, response slots,
  head_dim). With grouped-query attention the caches hold the key/value heads only. The prompts of a
  chunk are left-padded to a common length L; every row starts generating together, so step ``s``
  writes response slot ``s - 1`` for every row at once. Position ids count only real tokens, exactly
  as ``HFEngine`` (a padded prompt sees the positions of an unpadded one). At the suggested config
  (32 prompts of ~160 tokens x 8 samples, 512 new tokens) sharing the prompt saves about a quarter of
  the cache.
* **Own decode step over the model's weights, one step for every family.** The step reads the
  model's own parameters (projections, RMS norms, MLP, LM head) but does the attention itself
  against the static buffers, so there is no Python cache object and no data-dependent host sync in
  the step. That is what makes it capturable. The layer's layout (pre- or post-norm, q/k norms over
  all heads or per head, biases, grouped-query heads, head_dim, tied embeddings) is read from the
  model's config and modules; the families differ in one row of ``families.FAMILIES``. Any other
  architecture raises a one-line error that names the supported ones and the ``hf`` engine.
* **One CUDA graph per (batch bucket, sampling mode)**, and per length bucket on the SDPA path. A
  graph replays one whole step: embedding, every layer, LM head, sampling, log-prob, writing the
  token and log-prob to the output buffers and advancing the position/slot/step counters on the
  device. The host launches replays back to back. Attention (``rlvr.engines.fast.kernels.decode_attention``) reads
  each row's prompt slots from its group's entry and its filled response slots: on CUDA one Triton
  kernel that reads the lengths on the device (one graph per batch bucket), elsewhere a gather and
  SDPA over the filled slots rounded up to ``length_bucket``. With several samples per prompt and a
  large enough batch bucket (``cascade_min_rows``), the Triton path reads each shared prompt once
  per step for all of its rows (cascade attention) and each row then reads only its response. With
  grouped-query attention one program takes all the query heads of a key/value head, so each cache
  block is read once for them.
* **Prefill once per prompt.** The chunk's prompts are prefilled once (causal, padding-masked) into
  the prompt cache, through the same compiled pieces as the decode step; the ``n`` rows of a prompt's
  samples point at it.
* **Sampling inside the graph.** Exponential race: with E_i ~ Exp(1), ``argmax_i p_i / E_i`` is
  distributed exactly as a draw from ``p`` (the same distribution as ``torch.multinomial``, not the
  same draws as ``HFEngine``); it is computed as ``argmax_i (score_i - log E_i)``, which needs no
  softmax pass over the vocabulary. Where Triton runs (CUDA) the draws are counter-based
  (``sampling_kernel.CounterNoise``: Philox keyed by one seed per chunk from the caller's seeded
  generator, counted by output row, step and token), made inside the sampling kernel as it reads the
  logits, so a step writes and reads no noise tensor and a row's draws do not depend on where it sits
  in the batch; elsewhere a noise buffer is filled from the generator outside the graph by one kernel
  per step. Either way the same seed reproduces the batch. Temperature 0 is argmax; top-p keeps the
  smallest set of tokens whose mass reaches p (same rule as ``sampling.sample_next``). The sampled
  token's log-probability under the temperature-1 full-vocabulary distribution comes from the
  same logits.
* **Few host syncs, overlapped** (``stops``). The host reads the new tokens every ``sync_every`` steps
  and checks EOS and stop strings then, one sync period behind the device (the copy is asynchronous
  and the device runs the next steps while the host examines), token by token as ``HFEngine`` does (a
  stop found in the decoded new span is located at the exact token that completed it), so rows that
  ran past their stop are cut on the host and text, token ids, log-probs and finish reasons equal
  per-token checking.
* **Retiring rows.** A row the host finds finished is flagged on the device at once, and the
  attention skips it from the next step on; when the rows still running fit a smaller batch bucket,
  they move to the first batch rows and the smaller bucket's graph takes over. Only the per-row
  indices move: each row keeps its response cache row (``State.crow``), so no K/V is copied.
* **Continuing conversations** (``FastHFEngine.continuing()``, which multi-turn rollouts enter). Inside
  it, each row's context after its completion (the prompt's K/V, then the K/V of every completion
  token that was fed, i.e. all but the last) is kept in a ``prefix.PrefixStore`` with its token ids:
  the finished rows' response K/V are gathered out of the response cache in one copy a layer per sync
  point (before a compaction can hand their cache rows to fillers), and at the end of the chunk packed
  with the prompts' K/V (held once for a prompt's samples) into a few blocks. A later prompt takes the
  K/V of the longest leading run of tokens it shares with a kept context (found by bisecting the kept
  contexts in token order; gathered into its prompt-cache entry, at the same positions, one scatter a
  layer per block) and only the rest is prefilled, attending to the copied part. What is prefilled
  again: the last token of the model's turn, the environment's message, the next turn's header, and
  any token where the re-tokenised conversation text differs from the sampled ids. Blocks that hold
  more than the kept contexts use are repacked at the end of each call; the kept K/V stay on the
  device until the context exits (``sync_weights`` drops them: they belong to the old weights).

The package: ``families`` (the supported families and one model's layout), ``step`` (a layer's step
and the sampling as pure functions, compiled or eager), ``state`` (the device buffers), ``graphs``
(capture and replay), ``stops`` (host-side checks), ``prefix`` (the kept contexts of
``continuing``) and ``engine`` (the chunk loop). On CPU (or with
``use_cuda_graphs=False``) the same step runs eagerly; CPU tests prove it equals ``HFEngine`` and
``model.generate`` for every family.
"""

from rlvr.engines.fast.engine import DEFAULT_BATCH_BUCKETS, FastHFEngine
from rlvr.engines.fast.families import FAMILIES, layout_of, unsupported_reason

__all__ = ["DEFAULT_BATCH_BUCKETS", "FAMILIES", "FastHFEngine", "layout_of", "unsupported_reason"]
