"""Atomic training checkpoints: model + tokenizer, optimizer, scheduler, RNG states, loop position.

Layout under a run directory::

    checkpoints/step_000040/model/        save_pretrained (weights, config) + tokenizer
    checkpoints/step_000040/adapter/      (LoRA runs) the adapters alone, a folder peft loads onto the base model
    checkpoints/step_000040/trainer_state.pt   optimizer, scheduler, RNG states, step, data position, counters
    checkpoints/step_000040/sharded/      (FSDP2 and LoRA runs) model and optimizer shards, torch.distributed.checkpoint
    checkpoints/step_000040/rng/rank_K.pt (several processes) each rank's RNG states
    checkpoints/step_000040/manifest.json size and sha256 of every other file, written last
    checkpoints/latest                    a relative symbolic link to the newest complete checkpoint
    checkpoints/best/model/               the model of the best validation so far (by the main validation
                                          reward, ties to the later step), kept apart from the rolling ones
    checkpoints/best/adapter/             (LoRA runs) that model's adapters alone
    checkpoints/best/best.json            its step and validation metrics

A checkpoint is written into a hidden temporary directory, every file is fsynced, and only then is
the directory renamed to its final name (a rename within one filesystem is atomic) and ``latest``
replaced (a new link renamed over the old one). A crash at any point leaves the previous checkpoint complete and
``latest`` pointing at a complete directory; leftovers of an interrupted write are ignored and
cleaned up by the next save or resume. Old checkpoints are pruned by renaming them to a trash name
first, then deleting, so that a kill midway never leaves half a checkpoint under a step's name.

A checkpoint damaged later (a truncated or overwritten file) is caught on resume:
``resumable_checkpoint`` checks every file against the manifest, sets a damaged checkpoint aside as
``checkpoints/damaged-step_N`` and falls back to the newest intact one, saying so. A checkpoint
without a manifest (an older version's, a copy) is checked file by file to load, and said to be
checked only that far. One that holds weights but no ``trainer_state.pt`` (deleted to save disk) is
never taken for "no checkpoint": it is passed over for an older complete one (said), or resumed with
a fresh optimizer when the user asks (``--fresh-optimizer``), or the resume stops naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlvr.distributed.checkpoint import export_adapter, export_hf, load_sharded, save_sharded
from rlvr.distributed.world import barrier, current_world
from rlvr.distributed.wrap import unwrap_model
from rlvr.errors import UserError
from rlvr.training.lora import is_lora
from rlvr.training.rundir import atomic_write_text
from rlvr.training.rundir import fsync_dir as _fsync_dir

if TYPE_CHECKING:
    from torch import nn
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
MANIFEST = "manifest.json"
SHARDED_DIR = "sharded"
RNG_DIR = "rng"
DAMAGED_PREFIX = "damaged-"
LATEST = "latest"
BEST_DIR = "best"
BEST_RECORD = "best.json"
TRASH_PREFIX = ".trash-"
RUN_CONFIG = "run_config.json"
OLD_PREFIX = ".old-"

__all__ = [
    "atomic_write_text",
    "save_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "save_best_model",
    "best_model",
    "run_model",
    "resumable_checkpoint",
    "checkpoint_dirs",
    "verify_checkpoint",
    "load_model_weights",
    "load_trainer_state",
    "CheckpointError",
]


class CheckpointError(UserError):
    """No intact checkpoint to resume from."""


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


# ---------------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checkpoint_files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt_dir: str | Path) -> dict:
    """Record the size and sha256 of every file of ``ckpt_dir`` in its ``manifest.json``."""
    ckpt_dir = Path(ckpt_dir)
    files = {
        rel: {"size": (ckpt_dir / rel).stat().st_size, "sha256": file_sha256(ckpt_dir / rel)}
        for rel in _checkpoint_files(ckpt_dir)
    }
    manifest = {"format": 1, "files": files}
    atomic_write_text(ckpt_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


WEIGHTS_ONLY = f"{STATE_FILE} is missing"
"""The one problem of a checkpoint that holds whole weights but no optimizer state (``--fresh-optimizer`` resumes it)."""


def verify_checkpoint(ckpt_dir: str | Path) -> list[str]:
    """Problems of a checkpoint (empty: intact), each naming the file. With a manifest every file is
    checked against its size and sha256; without one (older versions, a copy) each file is checked
    to load: safetensors headers against the file sizes, the torch states, the JSON files. A
    checkpoint that holds weights but no ``trainer_state.pt`` has exactly the problem ``WEIGHTS_ONLY``."""
    ckpt_dir = Path(ckpt_dir)
    problems = [] if (ckpt_dir / STATE_FILE).is_file() else [WEIGHTS_ONLY]
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return problems + _load_problems(ckpt_dir)
    try:
        files = json.loads(path.read_text())["files"]
        files.items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return problems + [f"{MANIFEST} is unreadable"]
    for rel, want in files.items():
        f = ckpt_dir / rel
        if rel == STATE_FILE and problems:
            continue  # reported above
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{rel} has {f.stat().st_size} bytes, expected {want['size']}")
        elif file_sha256(f) != want["sha256"]:
            problems.append(f"{rel} does not match its checksum")
    return problems


def verified_by_manifest(ckpt_dir: str | Path) -> bool:
    """Whether ``verify_checkpoint`` compared every byte (a manifest) or only checked that the files load."""
    return (Path(ckpt_dir) / MANIFEST).is_file()


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` cannot be whole (its header against its size), or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n < 2**31:  # the safetensors format caps its header far below this
                return "is not a safetensors file (no valid header)"
            if n > size - 8:
                return f"has {size} bytes, fewer than its header alone ({8 + n})"
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "has an unreadable safetensors header"
    want = 8 + n + max(ends, default=0)
    if size != want:
        return f"has {size} bytes, its header describes {want}"
    return None


def _load_problems(ckpt_dir: Path) -> list[str]:
    """The files of a checkpoint without a manifest that do not load (see ``verify_checkpoint``)."""
    problems = []
    model_dir = ckpt_dir / MODEL_DIR
    weights = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not weights and not (ckpt_dir / SHARDED_DIR).is_dir():
        problems.append(f"{MODEL_DIR}/ holds no *.safetensors weights")
    return problems + file_problems(ckpt_dir)


def file_problems(root: Path) -> list[str]:
    """``"<file> <why>"`` for each safetensors, JSON or torch file under ``root`` that does not load whole."""
    problems = []
    for f in sorted(root.rglob("*")):
        if not f.is_file():
            continue
        rel = str(f.relative_to(root))
        if f.suffix == ".safetensors":
            why = safetensors_problem(f)
        elif f.suffix == ".json":
            try:
                json.loads(f.read_text(encoding="utf-8"))
                why = None
            except (OSError, ValueError):
                why = "is not valid JSON"
        elif f.suffix == ".pt":
            try:
                torch.load(f, map_location="cpu", weights_only=False)
                why = None
            except Exception as e:  # a damaged pickle raises anything from EOFError to UnpicklingError
                why = f"does not load ({type(e).__name__})"
        else:
            continue
        if why:
            problems.append(f"{rel} {why}")
    return problems


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


def write_model(
    model_dir: Path, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, sharded: bool = False
) -> None:
    """The full model (LoRA merged) and its tokenizer in Hugging Face format in ``model_dir``: gathered
    tensor by tensor when ``sharded`` (every rank calls), else written by rank 0 alone."""

    if sharded:
        export_hf(model, model_dir, tokenizer)
    elif current_world().is_main:
        plain: Any = unwrap_model(model)
        plain.save_pretrained(str(model_dir))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(model_dir))


def write_adapter(adapter_dir: Path, model: nn.Module) -> None:
    """A LoRA model's adapters alone in ``adapter_dir``, the folder ``peft.PeftModel.from_pretrained``
    loads onto the base model (gathered when sharded; every rank calls); nothing for other models."""
    if is_lora(unwrap_model(model)):
        export_adapter(model, adapter_dir)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    state: dict[str, Any],
    keep: int = 1,
    sharded: bool = False,
    run_config: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and drop all but the newest ``keep``. Returns its directory.

    ``state`` holds the loop's own position (data position, counters); RNG states are added here.
    ``run_config`` (the run's config as a dict) is kept as ``run_config.json``, under the manifest's
    checksum: the config the checkpoint was trained with, against which a resume checks the run's
    ``config.json`` (``saved_run_config``).
    Under a process group every rank must call it: each writes its RNG state (``rng/rank_K.pt``), and
    rank 0 the rest. ``sharded`` (FSDP2, LoRA): the model's trainable tensors and the optimizer go to
    ``sharded/`` through ``torch.distributed.checkpoint`` (each rank its shards, loadable on any number
    of ranks), and ``model/`` holds the full weights (LoRA merged) gathered tensor by tensor; otherwise
    rank 0 writes the model with ``save_pretrained`` and the optimizer into ``trainer_state.pt``
    (a DDP optimizer is the same on every rank). Several nodes need a run directory they all share.
    """

    world = current_world()
    root = Path(run_dir) / CKPT_DIR
    name = f"step_{step:06d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    if sharded:
        save_sharded(tmp / SHARDED_DIR, model, optimizer)
    write_model(tmp / MODEL_DIR, model, tokenizer, sharded)
    write_adapter(tmp / ADAPTER_DIR, model)
    if world.distributed:
        (tmp / RNG_DIR).mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / RNG_DIR / f"rank_{world.rank}.pt")
    barrier()
    if world.is_main:
        torch.save(
            {
                "step": step,
                "format": "sharded" if sharded else "full",
                "world_size": world.world_size,
                "optimizer": None if sharded else optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_state(),
                "loop": state,
            },
            tmp / STATE_FILE,
        )
        if run_config is not None:
            (tmp / RUN_CONFIG).write_text(json.dumps(run_config, indent=2) + "\n")
        _commit(run_dir, tmp, final, keep)
    barrier()
    return final


def _commit(run_dir: str | Path, tmp: Path, final: Path, keep: int) -> None:
    """Checksum, fsync and rename the written ``tmp`` into place as ``final``, point ``latest`` at it
    and drop all but the newest ``keep`` checkpoints."""
    root = final.parent
    write_manifest(tmp)
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. the final save right after a periodic one)
        old = root / f"{OLD_PREFIX}{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        _discard(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    point_latest(root, final.name)
    for stale in list_checkpoints(run_dir)[:-keep]:
        if stale != final:
            _discard(stale)
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _discard(path: Path) -> None:
    """Delete a checkpoint directory so that a kill midway leaves no part of it under its name: it
    is renamed to a trash name first (atomic), then deleted; ``clean_leftovers`` ends an
    interrupted deletion."""
    trash = path.with_name(TRASH_PREFIX + path.name)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(run_dir: str | Path) -> None:
    """Finish what a killed save or prune left in ``checkpoints/`` (call it under the run's lock):
    trash and temporary directories are deleted, and a checkpoint that was being replaced by a
    save of the same step is put back if its replacement never arrived."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return
    for old in root.glob(OLD_PREFIX + "*"):
        final = root / old.name.removeprefix(OLD_PREFIX)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    for leftover in [*root.glob(TRASH_PREFIX + "*"), *root.glob(".tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def saved_run_config(ckpt_dir: str | Path) -> dict[str, Any] | None:
    """The run config a checkpoint was trained with (its ``run_config.json``), or None when it has none."""
    path = Path(ckpt_dir) / RUN_CONFIG
    try:
        saved = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def edited_settings(ckpt_dir: str | Path, current: dict[str, Any], may_change: tuple[str, ...]) -> list[str]:
    """Top-level settings of ``current`` (a command's flat config) that differ from those the
    checkpoint was trained with, but those in ``may_change``; empty when it kept no config."""
    trained = saved_run_config(ckpt_dir)
    if trained is None:
        return []
    return sorted(k for k in current if k not in may_change and k in trained and trained[k] != current[k])


def refuse_edited_settings(ckpt_dir: Path, current: dict[str, Any], may_change: tuple[str, ...], file: Path) -> None:
    """Raise ``CheckpointError`` naming the settings of ``file`` (the run's saved config) that differ
    from those the checkpoint ``ckpt_dir`` was trained with."""
    edited = edited_settings(ckpt_dir, current, may_change)
    if edited:
        raise CheckpointError(
            f"cannot resume: {', '.join(edited)} in {file} differ from the config {ckpt_dir.name} was trained with "
            f"({ckpt_dir.name}/{RUN_CONFIG}; was the file edited?); put them back (on resume only "
            f"{', '.join(k for k in may_change if k != 'out')} may change, by flags)"
        )


def checkpoint_format(ckpt_dir: str | Path) -> str:
    """``full`` (model folder + optimizer in trainer_state.pt) or ``sharded`` (DCP folder)."""
    return "sharded" if (Path(ckpt_dir) / SHARDED_DIR).is_dir() else "full"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories (with their ``trainer_state.pt``), oldest first."""
    return [p for p in checkpoint_dirs(run_dir) if (p / STATE_FILE).is_file()]


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every committed checkpoint directory (``step_N``), whole or not, oldest first: a run that has
    one has been checkpointed and is never started over."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))


def point_latest(root: Path, name: str) -> None:
    """Make ``root/latest`` a relative link to checkpoint ``name``: a new link renamed over the old
    one (a text file naming it, as older runs wrote, is replaced the same way)."""
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (by the ``latest`` link, else by scanning), or None."""
    root = Path(run_dir) / CKPT_DIR
    pointer = root / LATEST
    if pointer.is_symlink():
        cand = root / os.readlink(pointer)
        if (cand / STATE_FILE).is_file():
            return cand
    elif pointer.is_file():  # the text pointer of runs written before the link
        cand = root / pointer.read_text().strip()
        if (cand / STATE_FILE).is_file():
            return cand
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def damaged_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    return sorted(root.glob(DAMAGED_PREFIX + "*")) if root.is_dir() else []


def _set_aside(ckpt: Path) -> Path:
    target = ckpt.with_name(DAMAGED_PREFIX + ckpt.name)
    n = 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{DAMAGED_PREFIX}{ckpt.name}.{n}")
    os.replace(ckpt, target)
    return target


def resumable_checkpoint(
    run_dir: str | Path, echo: Callable[[str], object] | None = None, fresh_optimizer: bool = False
) -> Path | None:
    """The newest checkpoint of ``run_dir`` that passes ``verify_checkpoint``, or None when the run
    has none (it starts from the beginning).

    A damaged checkpoint is renamed ``checkpoints/damaged-step_N`` (kept for inspection, never
    loaded or counted again) and the next older one is tried; a checkpoint holding weights only (no
    ``trainer_state.pt``) is passed over, unless ``fresh_optimizer``: then it is the one returned.
    ``echo`` (default: stderr) is told of each and of the fall-back. Raises ``CheckpointError`` when
    checkpoints exist but none can be resumed: starting over silently would throw the run away.
    """
    echo = echo or (lambda msg: print(msg, file=sys.stderr))
    run_dir = Path(run_dir)
    clean_leftovers(run_dir)
    set_aside: list[Path] = []
    weights_only: list[Path] = []
    for ckpt in reversed(checkpoint_dirs(run_dir)):
        problems = verify_checkpoint(ckpt)
        if not problems or (fresh_optimizer and problems == [WEIGHTS_ONLY]):
            if problems:
                echo(f"rlvr: resuming from the weights of {ckpt.name} with a fresh optimizer ({WEIGHTS_ONLY})")
            elif set_aside or weights_only:
                for passed in weights_only:
                    echo(
                        f"rlvr: checkpoint {passed.name} holds weights only ({WEIGHTS_ONLY}); passing over it (resume "
                        "with --fresh-optimizer instead to continue from its weights with a fresh optimizer)"
                    )
                point_latest(run_dir / CKPT_DIR, ckpt.name)
                echo(f"rlvr: resuming from {ckpt.name}, the newest intact checkpoint")
            if not verified_by_manifest(ckpt):
                echo(
                    f"rlvr: {ckpt.name} has no {MANIFEST}: its files load, but changed bytes cannot be detected "
                    "without the checksums"
                )
            return ckpt
        if problems == [WEIGHTS_ONLY]:
            weights_only.append(ckpt)  # said only if an older checkpoint is resumed instead
            continue
        moved = _set_aside(ckpt)
        set_aside.append(moved)
        echo(
            f"rlvr: checkpoint {ckpt.name} failed verification ({'; '.join(problems[:3])}); set it aside as "
            f"{moved.relative_to(run_dir)}"
        )
    if weights_only:
        raise CheckpointError(
            f"{run_dir} has no complete checkpoint to resume from: {weights_only[0].relative_to(run_dir)} holds weights "
            f"only ({WEIGHTS_ONLY}). To continue from its weights with a fresh optimizer (the learning-rate "
            "schedule goes on from its step), resume with --fresh-optimizer"
        )
    if set_aside or damaged_checkpoints(run_dir):
        raise CheckpointError(
            f"{run_dir} has no intact checkpoint to resume from (damaged ones are under {run_dir / CKPT_DIR}/"
            f"{DAMAGED_PREFIX}*); keep more with keep_checkpoints >= 2 next time. Start a new run with another --out, "
            f"or delete {run_dir / CKPT_DIR} to train this one again from step 0"
        )
    return None


def save_best_model(
    run_dir: str | Path,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    record: dict[str, Any],
    sharded: bool = False,
) -> Path:
    """Write ``checkpoints/best`` (``model/`` in Hugging Face format and ``best.json`` = ``record``),
    replacing the previous best atomically: it is written beside it, then renamed into place. Under a
    process group every rank must call it (a sharded model is gathered)."""

    world = current_world()
    root = Path(run_dir) / CKPT_DIR
    final, tmp, old = root / BEST_DIR, root / f".tmp-{BEST_DIR}", root / f".old-{BEST_DIR}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover)
        tmp.mkdir()
    barrier()
    write_model(tmp / MODEL_DIR, model, tokenizer, sharded)
    write_adapter(tmp / ADAPTER_DIR, model)
    barrier()
    if world.is_main:
        (tmp / BEST_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return final


def best_model(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """``(checkpoints/best/model, its record)`` of a run, or None when it has no best model yet."""
    best = Path(run_dir) / CKPT_DIR / BEST_DIR
    if not (best / MODEL_DIR / "config.json").is_file():
        return None
    try:
        record = json.loads((best / BEST_RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    return best / MODEL_DIR, record if isinstance(record, dict) else {}


def run_model(run_dir: str | Path, which: str = "best") -> tuple[Path, str] | None:
    """The model folder a training run left and a line saying which: with ``which="best"`` its best
    model (checkpoints/best/model; the latest checkpoint's when the run kept no best), with
    ``"latest"`` its newest checkpoint's. None when ``run_dir`` is not a run with a saved model."""
    run_dir = Path(run_dir)
    if not (run_dir / CKPT_DIR).is_dir():
        return None
    best = best_model(run_dir) if which == "best" else None
    if best is not None:
        path, record = best
        value = record.get("val/reward")
        shown = f", val/reward {value:.3f}" if isinstance(value, (int, float)) else ""
        return path, f"its best model (step {record.get('step', '?')}{shown})"
    latest = latest_checkpoint(run_dir)
    if latest is None or not (latest / MODEL_DIR / "config.json").is_file():
        return None
    why = "" if which == "latest" else " (it kept no best model)"
    return latest / MODEL_DIR, f"its latest checkpoint, {latest.name}{why}"


def load_model_weights(model: nn.Module, model_dir: str | Path) -> None:
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


def load_trainer_state(
    ckpt_dir: str | Path,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG states (and, from a sharded checkpoint, ``model``'s
    trainable tensors, on any number of ranks); returns the loop state saved with them. Each rank
    takes its own RNG state when the checkpoint has one for its rank, else rank 0's (a run resumed on
    more ranks than wrote it: the extra ranks keep their seeded state)."""

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / STATE_FILE).is_file():
        return _fresh_optimizer_state(ckpt_dir, scheduler)
    blob = torch.load(ckpt_dir / STATE_FILE, map_location="cpu", weights_only=False)
    if checkpoint_format(ckpt_dir) == "sharded":
        if model is None:
            raise ValueError(f"{ckpt_dir} is a sharded checkpoint: pass the model to load it into")

        load_sharded(ckpt_dir / SHARDED_DIR, model, optimizer)
    else:
        optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    rank = current_world().rank
    own = ckpt_dir / RNG_DIR / f"rank_{rank}.pt"
    if own.is_file():
        set_rng_state(torch.load(own, map_location="cpu", weights_only=False))
    elif rank == 0:
        set_rng_state(blob["rng"])
    return {"step": blob["step"], **blob["loop"]}


def _fresh_optimizer_state(ckpt_dir: Path, scheduler: LRScheduler | None) -> dict[str, Any]:
    """The loop state of a weights-only checkpoint: its step (from its name), the optimizer as
    created, and the learning-rate schedule moved to that step."""
    if checkpoint_format(ckpt_dir) == "sharded":
        raise CheckpointError(
            f"{ckpt_dir} is a sharded checkpoint without {STATE_FILE}: its trainable tensors cannot be told from "
            "its optimizer state; resume from another checkpoint"
        )
    step = int(ckpt_dir.name.split("_")[1])
    if scheduler is not None:
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas is None:
            raise CheckpointError(f"{ckpt_dir}: only a LambdaLR schedule can be moved to step {step}")
        scheduler.last_epoch = step
        for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lambdas):
            group["lr"] = base * fn(step)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # type: ignore[attr-defined]
    return {"step": step, "fresh_optimizer": True}
