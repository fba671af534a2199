"""Where the packed train phase's first step goes: compiling, piece by piece, at OLMo-2-1B's shape.

``optim.shared_prefix``'s first ``rlvr train`` step took minutes on one H200 (docs/benchmarks.md,
"Shared prompts, packed"). This times each piece of a packed microbatch from an empty compile cache
(``torch._dynamo.reset`` before each part), first call against a warm one:

- the block mask (compiled ``create_block_mask``) at three pack lengths;
- one layer's FlexAttention, forward and backward, compiled for the token budget's length and for
  symbolic lengths (on the CPU, forward only: FlexAttention has no CPU backward);
- each packed microbatch of a GRPO batch (32 prompts x 8 synthetic responses, a 16,384-token budget)
  through ``model.compile``'s backbone and the head, forward and backward, and the same batch padded.

Then dynamo's own timers of compile time by stage, for the microbatches. On the CPU (``--tiny``) packs take the dense mask,
so the backbone rows are not FlexAttention's; the run only checks that the probe works.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/packing_warmup.py --data-dir DIR [--tiny]``.
"""

from __future__ import annotations

import torch
from bench_speed import Bench, probe_bench, probe_parser

from rlvr.grpo import compile_backbone, get_response_log_probs, packing
from rlvr.grpo.packing import (
    FLEX_BLOCK,
    attention_mask,
    pack_rows,
    packed_response_log_probs,
    shared_prefix_plan,
    visible,
)
from rlvr.grpo.train_step import microbatch_plan


def synthetic_batch(bench: Bench, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, response_mask) laid out as ``tokenize_prompt_and_output`` does, for the
    bench's GRPO batch: random token ids, prompts of GSM8K-like length, responses of its length range."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prompt_range = (8, 16) if bench.tiny else (100, 170)
    sequences, prompt_lens = [], []
    for _ in range(bench.rl_prompts):
        prompt = torch.randint(5, len(bench.tok), (draw(*prompt_range),), generator=g)
        for _ in range(bench.group):
            response = torch.randint(5, len(bench.tok), (draw(bench.len_lo, bench.len_hi),), generator=g)
            sequences.append(torch.cat([prompt, response]))
            prompt_lens.append(len(prompt))
    width = max(len(s) for s in sequences) - 1
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    labels = torch.zeros_like(input_ids)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        input_ids[i, : len(seq) - 1], labels[i, : len(seq) - 1] = seq[:-1], seq[1:]
        mask[i, p - 1 : len(seq) - 1] = True
    return input_ids, labels, mask


_cpu_block_mask = None


def block_mask(pack, device: torch.device):
    """The pack's FlexAttention ``BlockMask``: the trainer's on CUDA; on the CPU (where the trainer
    takes a dense mask) built the same way, a compiled ``create_block_mask`` over ``visible``."""
    global _cpu_block_mask
    if device.type == "cuda":
        return attention_mask(pack, device)
    if _cpu_block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        _cpu_block_mask = torch.compile(create_block_mask)
    n = pack.prompt.numel()
    return _cpu_block_mask(visible(pack.prompt, pack.segment), None, None, n, n, device="cpu")


def first_and_warm(bench: Bench, fn) -> tuple[float, float]:
    """Seconds of the first call of ``fn`` and of a second one."""
    return bench.timed(fn)[1], bench.timed(fn)[1]


def main() -> None:
    ap = probe_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    bench = probe_bench(args)
    model, device = bench.model, bench.device
    cuda = device.type == "cuda"
    budget = 256 if bench.tiny else 16_384
    align = FLEX_BLOCK if cuda else 1
    full_length = -(-budget // align) * align
    input_ids, labels, mask = synthetic_batch(bench)
    keep = [True] * input_ids.shape[0]
    plan = shared_prefix_plan(input_ids, mask, keep, input_ids.shape[0], budget)
    assert plan is not None
    width = input_ids.shape[1]
    packs = [pack_rows(input_ids, mask, rows, width, align, budget) for rows in plan]
    lengths = [p.input_ids.shape[1] for p in packs]
    print(f"{len(plan)} packs of {lengths} tokens (budget {budget:,}; {sum(p.n_tokens for p in packs):,} real)")
    # Each row is printed as soon as it is measured: a run cut short by a time limit still reports
    # the pieces it finished.
    print("\n| piece | first call s | warm call s |\n|---|---:|---:|", flush=True)

    def report(what: str, first: float, warm: float) -> None:
        print(f"| {what} | {first:.2f} | {warm:.3f} |", flush=True)

    # the block mask at three lengths: the first compiles, the second compiles for symbolic lengths
    torch._dynamo.reset()
    by_length = {p.input_ids.shape[1]: p for p in packs}
    for n, pack in list(by_length.items())[:3]:
        first, warm = first_and_warm(bench, lambda pack=pack: block_mask(pack, device))
        report(f"block mask, {n:,} tokens", first, warm)

    # one layer's attention: FlexAttention for the budget's length, then for symbolic lengths
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    torch._dynamo.reset()
    packing._compiled_flex.clear()
    for n, pack in list(by_length.items())[:3]:
        block = block_mask(pack, device)
        q = torch.randn(1, heads, n, head_dim, device=device, dtype=bench.dtype, requires_grad=cuda)
        k, v = (
            torch.randn(1, kv_heads, n, head_dim, device=device, dtype=bench.dtype, requires_grad=cuda) for _ in "kv"
        )
        full = n == full_length

        def attend(q=q, k=k, v=v, block=block, full=full) -> None:
            token = packing._full_pack.set(full)
            try:
                out = packing._flex_attention(q, k, v, block, head_dim**-0.5)
            finally:
                packing._full_pack.reset(token)
            if cuda:
                out.sum().backward()

        first, warm = first_and_warm(bench, attend)
        report(f"FlexAttention {'fixed' if full else 'symbolic'} length, {n:,} tokens", first, warm)

    # the whole packed microbatch, then the same batch padded, through model.compile's backbone
    torch._dynamo.reset()
    packing._compiled_flex.clear()
    model.train()
    backbone = compile_backbone(model)
    for i, (rows_of_pack, n) in enumerate(zip(plan, lengths, strict=True)):

        def packed(rows_of_pack=rows_of_pack) -> None:
            out = packed_response_log_probs(
                model, input_ids, labels, mask, rows_of_pack, width, 4096, True, backbone, budget
            )
            out["log_probs"].sum().backward()

        first, warm = first_and_warm(bench, packed)
        report(f"packed microbatch {i + 1}, {n:,} tokens", first, warm)
    model.zero_grad(set_to_none=True)
    lengths_padded = [max(1, int(r.nonzero().max()) + 1) if r.any() else 1 for r in mask]
    for i, rows_of_mb in enumerate(microbatch_plan(lengths_padded, keep, input_ids.shape[0], budget)[:3]):
        mb_width = max(lengths_padded[r] for r in rows_of_mb)

        def padded(rows_of_mb=rows_of_mb, mb_width=mb_width) -> None:
            index = torch.tensor(rows_of_mb)
            out = get_response_log_probs(
                model,
                input_ids[index, :mb_width],
                labels[index, :mb_width],
                True,
                chunk_tokens=4096,
                backbone=backbone,
                positions=mask[index, :mb_width],
            )
            out["log_probs"].sum().backward()

        first, warm = first_and_warm(bench, padded)
        report(f"padded microbatch {i + 1}, {len(rows_of_mb)} x {mb_width}", first, warm)
    model.zero_grad(set_to_none=True)
    model.eval()

    from torch._dynamo.utils import compilation_time_metrics

    print(
        "\n## compile time by stage since the last reset, the microbatches (dynamo's timers; half a second or more)",
        flush=True,
    )
    for name, seconds in sorted(compilation_time_metrics.items(), key=lambda kv: -sum(kv[1])):
        if sum(seconds) >= 0.5:
            print(f"{name}: {sum(seconds):.1f} s in {len(seconds)} calls")


if __name__ == "__main__":
    main()
