"""``torchrun --nproc-per-node 2`` over the miniature rollout step (``distributed_recipe.py``): DDP and
FSDP2, full fine-tuning and LoRA, two rollout steps of two epochs of shuffled minibatches with AdamW,
end at the one-process weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import distributed_recipe
import torch

TESTS = Path(__file__).resolve().parents[1]


def test_torchrun_two_ranks_train_like_one_process(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(TESTS / "distributed_recipe.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "weights.pt")
    # The ranks ran single-threaded; the reference must sum in the same order. Restored after, so the
    # rest of the suite keeps its threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        references = {False: distributed_recipe.train(None), True: distributed_recipe.train("reference-lora")}
    finally:
        torch.set_num_threads(threads)
    start = distributed_recipe.tiny_causal_lm(seed=0).state_dict()
    for variant, weights in got.items():
        reference = references[variant.endswith("lora")]
        assert set(weights) == set(reference), variant
        moved = max(float((reference[n] - start[n]).abs().max()) for n in reference)
        assert moved > 1e-4, f"{variant}: training moved nothing"
        for name, tensor in reference.items():
            torch.testing.assert_close(
                weights[name], tensor, rtol=1e-5, atol=2e-6, msg=lambda m, where=f"{variant} {name}": f"{where}: {m}"
            )
