"""Crash-safe checkpoint files, written beside whatever else the directory holds.

A checkpoint is a set of files plus ``lowbit_state.json``, whose ``files`` entry lists each file
lowbit wrote with its sha256. lowbit never deletes or overwrites a file it did not write: in a
run directory that also holds logs or TensorBoard events, the checkpoint goes beside them.

Saving is a small journaled commit, so a process killed at any instant leaves either the
previous checkpoint or the new one, never a mix:

1. every rank writes into ``<dir>/.lowbit-staging/``; the main rank then writes the metadata
   there (the staging is complete once that file exists);
2. the previous checkpoint's metadata, then its files, move into ``<dir>/.lowbit-retired/``;
3. the new files move into ``<dir>``, the metadata last (the commit point);
4. ``.lowbit-retired/`` is removed.

The next save or load finishes or rolls back an interrupted commit (:func:`recover`). Every
file is read with ``torch.load(weights_only=True)``: a checkpoint can never run code on load.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from lowbit.kernel.errors import CheckpointError
from lowbit.kernel.notices import LowbitNote, note

from lowbit.runtime.atomic_write import write_atomically

METADATA_FILE = "lowbit_state.json"
STAGING_DIR = ".lowbit-staging"
RETIRED_DIR = ".lowbit-retired"
FORMAT_VERSION = 2
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# torch.save reports a failed write from its C++ zip writer as a RuntimeError naming these.
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter failed")


class CheckpointNote(LowbitNote):
    """lowbit cleaned up after an interrupted save (said once, on the main process)."""


# ---------------------------------------------------------------------- writing files


def write_file_atomically(obj: Any, path: Path, serialize: Callable[[Any, Any], None] = torch.save) -> None:
    """``serialize(obj, handle)`` (``torch.save`` by default) to ``path``, all or nothing
    (:mod:`lowbit.runtime.atomic_write`); a full disk is a clear error."""
    try:
        write_atomically(path, lambda handle: serialize(obj, handle))
    except (OSError, RuntimeError) as exc:
        if is_disk_full(exc):
            raise CheckpointError(disk_full_message(Path(path))) from exc
        raise


def write_json_atomically(data: Any, path: Path) -> None:
    write_file_atomically(
        data, path, lambda value, handle: handle.write(json.dumps(value, indent=2, sort_keys=True).encode())
    )


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _TORCH_WRITE_FAILURES)


def disk_full_message(path: Path) -> str:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return (
        f"The disk is full (or a file-size limit was reached) while writing {str(path)!r} ({free} there). "
        "The partial save was removed and the previous checkpoint is intact. Free some space, or save elsewhere."
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _relative_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _top_level(names: Any) -> set[str]:
    return {name.split("/", 1)[0] for name in names}


# ---------------------------------------------------------------------- the target directory


def check_target(directory: Path) -> Path:
    """Refuse targets where a checkpoint cannot sensibly go, before anything is written."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"save_state target {str(directory)!r} is a file, not a directory. Give a directory path."
        )
    if directory.resolve() == Path.cwd().resolve():
        raise CheckpointError(
            f"save_state({str(directory)!r}) would write the checkpoint into the current directory, among your "
            "project's files. Give a directory of its own, e.g. save_state('checkpoints/step_100')."
        )
    return directory


def recover_for_reading(directory: Path) -> None:
    """Before a load: finish or undo a save that was killed mid-way, holding the writers' lock, so
    that a reader never removes what a live writer is staging; a save under way (its lock held) is
    an error: the directory is being replaced. Main process only."""
    directory = Path(directory)
    if not (directory / STAGING_DIR).exists() and not (directory / RETIRED_DIR).exists():
        return  # nothing to recover (the common case: no lock taken)
    try:
        lock = _lock_for_saving(directory)
    except CheckpointError:
        raise CheckpointError(
            f"load_state({str(directory)!r}): a save_state is writing into that directory right now (it holds the "
            "directory's lock), so the checkpoint there is being replaced. Load it once that save has finished, "
            "or load another checkpoint."
        ) from None
    try:
        recover(directory)
    finally:
        os.close(lock)


def recover(directory: Path) -> None:
    """Finish or undo a save that was killed mid-way (main process only, holding the writers'
    lock; idempotent)."""
    directory = Path(directory)
    retired, staging = directory / RETIRED_DIR, directory / STAGING_DIR
    if retired.is_dir():
        if (directory / METADATA_FILE).exists():
            _remove_leftover(retired, directory)  # the commit finished; only the cleanup was left
        else:
            try:
                _roll_back(directory, retired, staging)
            except OSError as exc:
                raise CheckpointError(
                    f"{str(directory)!r} holds a save that was interrupted while it replaced the previous checkpoint, "
                    f"and it cannot be rolled back here ({exc.strerror or exc}: read-only storage?). Copy the "
                    "directory "
                    "to writable storage and load it from there: lowbit restores the previous checkpoint then."
                ) from None
            _note(
                f"{str(directory)!r}: a save was interrupted while it replaced the previous checkpoint; "
                "the previous checkpoint was restored."
            )
    if staging.is_dir() and _remove_leftover(staging, directory):
        _note(f"{str(directory)!r}: removed the partial files of an interrupted save ({STAGING_DIR}/).")


def _remove_leftover(path: Path, directory: Path) -> bool:
    """Remove what an interrupted save left; on storage lowbit cannot write (a read-only mount)
    leave it, say so, and go on: the committed checkpoint beside it loads all the same."""
    try:
        shutil.rmtree(path)
        return True
    except OSError as exc:
        _note(
            f"{str(directory)!r}: could not remove {path.name}/ left by an interrupted save ({exc.strerror or exc}); "
            "the committed checkpoint is read without it."
        )
        return False


def _roll_back(directory: Path, retired: Path, staging: Path) -> None:
    old_files = _top_level(_listed_files(retired / METADATA_FILE))
    new_files = _top_level(_listed_files(staging / METADATA_FILE)) - old_files
    for name in new_files:  # moved in by the interrupted commit: lowbit wrote them
        target = directory / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    for name in old_files:
        if (retired / name).exists():
            os.replace(retired / name, directory / name)
    os.replace(retired / METADATA_FILE, directory / METADATA_FILE)
    shutil.rmtree(retired)


def _listed_files(metadata_path: Path) -> list[str]:
    try:
        files = json.loads(metadata_path.read_text(encoding="utf-8")).get("files", {})
    except (OSError, ValueError, AttributeError):
        return []
    return list(files) if isinstance(files, dict) else []


def _note(message: str) -> None:
    note(message, CheckpointNote)


@dataclass
class StagedCheckpoint:
    """Where the ranks write their files, and the metadata the main rank commits with them."""

    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)


@contextmanager
def staged_save(directory: Path, is_main: bool, barrier: Callable[[], None]) -> Iterator[StagedCheckpoint]:
    """Yield a staging area to fill; on success commit it into ``directory`` (see module doc).

    On any error the staging area is removed and the previous checkpoint stays as it was.
    """
    directory = check_target(directory)
    staging = directory / STAGING_DIR
    lock = None
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        lock = _lock_for_saving(directory)
    try:
        if is_main:
            recover(directory)
            staging.mkdir()
        barrier()
        staged = StagedCheckpoint(staging)
        try:
            yield staged
            barrier()
            if is_main:
                _commit(directory, staged)
        except BaseException:
            if is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        barrier()
    finally:
        if lock is not None:
            os.close(lock)  # the lock goes with the descriptor (and with the process, if it dies)


def _lock_for_saving(directory: Path) -> int:
    """One writer at a time per checkpoint directory: an exclusive ``flock`` on the directory
    itself (no lock file is left behind), held for the whole save. Two writers would otherwise mix
    their files (or trip over each other's staging area); a writer that dies releases the lock
    with its process."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"Another save_state is writing into {str(directory)!r} right now (it holds the directory's lock); two "
            "writers would mix their files. Let it finish, or save into another directory."
        ) from None
    return fd


def _commit(directory: Path, staged: StagedCheckpoint) -> None:
    staging, retired = staged.path, directory / RETIRED_DIR
    names = _relative_files(staging)
    previous = _listed_files(directory / METADATA_FILE) if (directory / METADATA_FILE).exists() else []
    previous_top = _top_level(previous)
    new_top = _top_level(names)
    clashes = sorted(name for name in new_top - previous_top if (directory / name).exists())
    if clashes:
        raise CheckpointError(
            f"save_state would overwrite {', '.join(clashes)} in {str(directory)!r}, which lowbit did not write. "
            "Move those files, or save the checkpoint into another directory."
        )
    metadata = {**staged.metadata, "format": FORMAT_VERSION, "files": {n: sha256_of(staging / n) for n in names}}
    write_json_atomically(metadata, staging / METADATA_FILE)  # the staging is now complete
    retiring: list[str] = []  # what moved aside, and what moved in, so far: undone if interrupted
    moved_in: list[str] = []
    try:
        if (directory / METADATA_FILE).exists():
            retired.mkdir(exist_ok=True)
            os.replace(directory / METADATA_FILE, retired / METADATA_FILE)
            retiring.append(METADATA_FILE)
            for name in previous_top:
                if (directory / name).exists():
                    os.replace(directory / name, retired / name)
                    retiring.append(name)
        for name in new_top:
            os.replace(staging / name, directory / name)
            moved_in.append(name)
        os.replace(staging / METADATA_FILE, directory / METADATA_FILE)  # the commit point
    except BaseException:  # Ctrl-C or an error mid-commit: put everything back as it was, then re-raise
        _undo_commit(directory, staging, retired, moved_in, retiring)
        raise
    shutil.rmtree(retired, ignore_errors=True)
    staging.rmdir()


def _undo_commit(directory: Path, staging: Path, retired: Path, moved_in: list[str], retiring: list[str]) -> None:
    """Move this save's files back into the staging area and the previous checkpoint's back in
    place, so the directory is as before the save (and the next save finds nothing in its way)."""
    for name in reversed(moved_in):
        if (directory / name).exists() and not (staging / name).exists():
            os.replace(directory / name, staging / name)
    for name in reversed(retiring):
        if (retired / name).exists():
            os.replace(retired / name, directory / name)
    shutil.rmtree(retired, ignore_errors=True)


# ---------------------------------------------------------------------- reading


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


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors, or a CheckpointError naming the file (a truncated file,
    a header that claims more than the file holds)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} cannot be read (truncated or corrupted safetensors): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None


def check_state_fits(module: torch.nn.Module, state: Any, path: Path) -> None:
    """Before anything is copied: ``state`` has exactly ``module``'s keys, each tensor of the same
    shape and dtype, or a CheckpointError naming the file and the first tensor that does not fit
    (``load_state_dict`` copies the tensors that fit before it raises, leaving a half-loaded model)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a model's state dict.")
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit this model: missing {missing[:5] or 'nothing'}, unexpected "
            f"{unexpected[:5] or 'nothing'}; nothing was loaded."
        )
    for name, target in expected.items():
        value = state[name]
        if not (torch.is_tensor(target) and torch.is_tensor(value)) or name.endswith("_extra_state"):
            continue  # a module's own extra state (TE's): its module checks it
        if value.shape != target.shape or value.dtype != target.dtype:
            raise CheckpointError(
                f"{path} does not fit this model: {name} is {tuple(value.shape)} {value.dtype} in the "
                f"file and {tuple(target.shape)} {target.dtype} in the model; nothing was loaded."
            )


def check_optimizer_state_fits(optimizer: Any, state: Any, path: Path) -> None:
    """The optimizer state has the optimizer's parameter groups, of the same sizes (what
    ``load_state_dict`` checks too, here before anything else is loaded)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointError(f"{path} is not an optimizer's state (no param_groups); nothing was loaded.")
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in groups]
    if mine != theirs:
        raise CheckpointError(
            f"{path} does not fit this optimizer: parameter groups of {theirs} parameters in the file, "
            f"{mine} here; nothing was loaded."
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _dict_of_str(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# Counters are int64 in torch and in the state lowbit restores; no job has more ranks than this.
MAX_COUNT = 2**63 - 1
MAX_WORLD_SIZE = 2**24


def _count(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_COUNT


def _world_size(value: Any) -> bool:
    return _is_int(value) and 1 <= value <= MAX_WORLD_SIZE


def _list_of_counts(value: Any) -> bool:
    return isinstance(value, list) and all(_count(v) for v in value)


# Every key lowbit writes, with its check and the type named in errors.
METADATA_SCHEMA: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (_is_int, "int"),
    "lowbit_version": (lambda v: isinstance(v, str), "str"),
    "mixed_precision": (lambda v: isinstance(v, str), "str"),
    "fp8_backend": (_str_or_none, "str or null"),
    "recipe": (_str_or_none, "str or null"),
    "strategy": (lambda v: isinstance(v, str), "str"),
    "world_size": (_world_size, f"an int from 1 to {MAX_WORLD_SIZE}"),
    "step": (_count, f"an int from 0 to {MAX_COUNT}"),
    "strategy_checkpoint": (lambda v: isinstance(v, bool), "bool"),
    "dataloader_epochs": (_list_of_counts, f"a list of ints from 0 to {MAX_COUNT}"),
    "custom_objects": (_count, f"an int from 0 to {MAX_COUNT}"),
    "files": (_dict_of_str, "mapping of file name to sha256"),
}


def read_metadata(directory: Path) -> dict[str, Any]:
    """The checkpoint's metadata, checked key by key against :data:`METADATA_SCHEMA`."""
    path = Path(directory) / METADATA_FILE
    if not path.exists():
        if not Path(directory).exists():
            raise CheckpointError(f"Checkpoint directory {str(directory)!r} does not exist.")
        raise CheckpointError(
            f"{str(directory)!r} is not a lowbit checkpoint: {METADATA_FILE} is missing "
            "(a save that never finished, or a directory written by another tool; a directory written by "
            "Accelerate's save_state is recognised by its model.safetensors / optimizer.bin / random_states_0.pkl)."
        )
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Checkpoint metadata {str(path)!r} cannot be read: {exc}.") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"Checkpoint metadata {str(path)!r} is damaged or was edited: {problem}.")
    return metadata


def _metadata_problem(metadata: Any) -> str:
    if not isinstance(metadata, dict):
        return f"expected a JSON object, found a {type(metadata).__name__}"
    unknown = sorted(set(metadata) - set(METADATA_SCHEMA))
    if unknown:
        return f"unknown key(s) {', '.join(map(repr, unknown))}"
    if metadata.get("format") != FORMAT_VERSION:
        return f"format {metadata.get('format')!r} is not {FORMAT_VERSION} (written by another lowbit version?)"
    missing = sorted(k for k in ("files", "mixed_precision", "strategy", "world_size", "step") if k not in metadata)
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    for key, value in metadata.items():
        check, expected = METADATA_SCHEMA[key]
        if not check(value):
            return f"{key!r} should be {expected}, found {value!r}"
    outside = next((name for name in metadata["files"] if not _inside_checkpoint(name)), None)
    if outside is not None:
        return f"file name {outside!r} is not a plain path inside the checkpoint"
    return ""


def _inside_checkpoint(name: str) -> bool:
    """A relative POSIX path below the checkpoint directory: no '..', '.', empty part, root or backslash."""
    parts = name.split("/")
    return bool(name) and "\\" not in name and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def verify_files(directory: Path, metadata: dict[str, Any], required: list[str]) -> None:
    """Every listed file is present and has the sha256 recorded at save time; ``required`` are listed."""
    directory = Path(directory)
    files: dict[str, str] = metadata["files"]
    for name in required:
        if name not in files:
            raise CheckpointError(f"Checkpoint {str(directory)!r} has no {name}; the checkpoint is incomplete.")
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {str(path)!r} is missing; the checkpoint is incomplete.")
        if sha256_of(path) != expected:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is corrupted: its sha256 differs from the one recorded when it was "
                "saved (a flipped bit on disk, or a file changed after saving). Resume from another checkpoint."
            )


def check_same_setup(metadata: dict[str, Any], expected: dict[str, Any], directory: Path) -> None:
    """Refuse a checkpoint written with another backend/precision: its state would not fit."""
    for key, value in expected.items():
        if metadata.get(key) != value:
            switch = (
                " To finish a run in another precision (e.g. FP8 -> bf16), load it with "
                "`accelerator.load_state(dir, allow_precision_change=True)`."
                if key in ("mixed_precision", "fp8_backend")
                else ""
            )
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} was saved with {key}={metadata.get(key)!r}, but this run uses "
                f"{key}={value!r}. Load it with the same setting, or load only the weights with "
                f"`safetensors.torch.load_file` of the file `accelerator.save_model` writes.{switch}"
            )
