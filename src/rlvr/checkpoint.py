"""Atomic training checkpoints: model + tokenizer, optimizer, scheduler, RNG states, loop position.

Layout under a run directory::

    checkpoints/step_000040/model/        save_pretrained (weights, config) + tokenizer
    checkpoints/step_000040/trainer_state.pt   optimizer, scheduler, RNG states, step, data position, counters
    checkpoints/latest                    name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, every file is fsynced, and only then is
the directory renamed to its final name (a rename within one filesystem is atomic) and ``latest``
replaced (write + fsync + rename). A crash at any point leaves the previous checkpoint complete and
``latest`` pointing at a complete directory; leftovers of an interrupted write are ignored and
cleaned up by the next save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see either the old or the new content."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler, state: dict,
                    keep: int = 1) -> Path:
    """Write checkpoint ``step`` atomically and drop all but the newest ``keep``. Returns its directory.

    ``state`` holds the loop's own position (data position, counters); RNG states are added here.
    """
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(str(tmp / MODEL_DIR))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / MODEL_DIR))
    torch.save({
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
        "loop": state,
    }, tmp / STATE_FILE)
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. the final save right after a periodic one)
        old = root / f".old-{name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_text(root / "latest", name + "\n")
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [p for p in root.glob("step_*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (by the ``latest`` pointer, else by scanning), or None."""
    root = Path(run_dir) / CKPT_DIR
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / STATE_FILE).is_file():
            return cand
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_model_weights(model, model_dir: str | Path) -> None:
    """Load the weights saved by ``save_pretrained`` in ``model_dir`` into ``model`` (in place, exact)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        state = load_file(str(single))
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(str(model_dir / shard)))
    else:
        raise FileNotFoundError(f"{model_dir} holds no model.safetensors; was it written by save_pretrained?")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied = {k for k in missing if "lm_head" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"the checkpoint in {model_dir} does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; resume with the same model configuration"
        )


def load_trainer_state(ckpt_dir: str | Path, optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNG states; returns the loop state saved with them."""
    blob = torch.load(Path(ckpt_dir) / STATE_FILE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    return {"step": blob["step"], **blob["loop"]}
