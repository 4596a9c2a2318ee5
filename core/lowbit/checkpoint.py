"""Crash-safe checkpoint files.

Everything is written under a temporary name and moved into place with a rename, so a process
killed mid-save leaves the previous good checkpoint where it was. Everything is read with
``torch.load(weights_only=True)``: a checkpoint can never run code on load.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from lowbit.errors import CheckpointError

METADATA_FILE = "lowbit_state.json"
_TMP_SUFFIX = ".lowbit-tmp"
_OLD_SUFFIX = ".lowbit-old"


def write_file_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` via a temp file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


@contextmanager
def atomic_directory(final: Path, is_main: bool, barrier: Callable[[], None]) -> Iterator[Path]:
    """Yield a temp directory to fill; on success it replaces ``final`` in two renames.

    All ranks write into the same temp directory; only the main rank creates and swaps it.
    """
    final = Path(final)
    tmp = final.with_name(final.name + _TMP_SUFFIX)
    old = final.with_name(final.name + _OLD_SUFFIX)
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an earlier crashed save
        tmp.mkdir(parents=True)
    barrier()
    yield tmp
    barrier()
    if is_main:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def resolve_checkpoint_dir(directory: Path) -> Path:
    """The checkpoint to read: ``directory``, or the previous one if a save died between renames."""
    directory = Path(directory)
    if (directory / METADATA_FILE).exists():
        return directory
    old = directory.with_name(directory.name + _OLD_SUFFIX)
    if (old / METADATA_FILE).exists():
        return old
    if not directory.exists():
        raise CheckpointError(f"Checkpoint directory {str(directory)!r} does not exist.")
    raise CheckpointError(
        f"{str(directory)!r} is not a lowbit checkpoint: {METADATA_FILE} is missing "
        "(a save that never finished, or a directory written by another tool)."
    )


def read_tensor_file(path: Path) -> Any:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"Checkpoint file {str(path)!r} is missing; the checkpoint is incomplete.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} cannot be read (truncated, corrupted, or not saved by lowbit): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def write_metadata(directory: Path, metadata: dict[str, Any]) -> None:
    (Path(directory) / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))


def read_metadata(directory: Path) -> dict[str, Any]:
    path = Path(directory) / METADATA_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"Checkpoint metadata {str(path)!r} cannot be read: {exc}.") from None


def check_same_setup(metadata: dict[str, Any], expected: dict[str, Any], directory: Path) -> None:
    """Refuse a checkpoint written with another backend/precision: its state would not fit."""
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} was saved with {key}={metadata.get(key)!r}, but this run uses "
                f"{key}={value!r}. Load it with the same setting, or load only the weights with "
                "`accelerator.load_model`/`torch.load` of a `save_model` file."
            )
