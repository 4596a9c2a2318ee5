"""Accelerate's automatic checkpoint naming: ``save_state()`` with no directory under
``ProjectConfiguration(automatic_checkpoint_naming=True)`` writes
``<project_dir>/checkpoints/checkpoint_<iteration>``, keeps the newest ``total_limit`` of them, and
``load_state()`` with no directory reads the newest.

Nothing is lost to a save that does not finish: old checkpoints are pruned only once the new one is
whole (its ``lowbit_state.json`` committed), so a save killed or refused half-way leaves every
checkpoint there was; and ``load_state()`` takes the newest *whole* one, saying which it passed over.
(Accelerate prunes first and loads the newest folder, whole or not.)"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Callable

from lowbit.kernel.errors import CheckpointError, ConfigError
from lowbit.kernel.notices import note

from lowbit.runtime.checkpoint.files import METADATA_FILE

NAME = re.compile(r"checkpoint_(\d+)")


def _root(project: Any, what: str) -> Path:
    if not project.automatic_checkpoint_naming:
        raise ConfigError(
            f"{what} needs a directory, or ProjectConfiguration(automatic_checkpoint_naming=True) to name one."
        )
    if project.project_dir is None:
        raise ConfigError(
            f"{what} with automatic_checkpoint_naming needs a project directory: "
            "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)."
        )
    return Path(project.project_dir) / "checkpoints"


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """The automatically named checkpoints under ``root``, oldest first."""
    found = [(int(m.group(1)), p) for p in root.glob("checkpoint_*") if p.is_dir() and (m := NAME.fullmatch(p.name))]
    return sorted(found)


def _whole(directory: Path) -> bool:
    """A save that reached its commit point (``files.recover`` finishes one killed after it)."""
    return (directory / METADATA_FILE).is_file()


def next_directory(project: Any) -> Path:
    """The directory of the next automatic checkpoint (nothing is removed here: see
    :func:`prune_after_save`). Advances ``project.iteration``."""
    root = _root(project, "save_state()")
    directory = root / f"checkpoint_{project.iteration}"
    if directory.exists():
        raise CheckpointError(
            f"{directory} exists already: ProjectConfiguration(iteration={project.iteration}) would "
            "overwrite it. Resume with load_state() (it sets the iteration after the newest) or "
            "choose another project_dir."
        )
    project.iteration += 1
    return directory


def save_automatically(project: Any, save: Callable[[Path], Path], is_main: bool, barrier: Callable[[], None]) -> Path:
    """``save`` into the next automatic name, every rank having seen that name is new; then, on the
    main process, prune (:func:`prune_after_save`). A save that raises prunes nothing."""
    directory = next_directory(project)
    barrier()
    saved = save(directory)
    if is_main:
        prune_after_save(project, saved)
    return saved


def prune_after_save(project: Any, saved: Path) -> list[Path]:
    """Once ``saved`` is whole: remove the checkpoints older than the newest ``total_limit`` whole
    ones (an unfinished one older than those too). Main process only. Returns what was removed."""
    if project.total_limit is None or not _whole(saved):
        return []
    existing = _numbered(saved.parent)
    whole = [path for _, path in existing if _whole(path)]
    kept = whole[-project.total_limit :] if project.total_limit > 0 else []
    oldest_kept = min((n for n, path in existing if path in kept), default=None)
    removed = [path for n, path in existing if path not in kept and (oldest_kept is None or n < oldest_kept)]
    for path in removed:
        shutil.rmtree(path)  # lowbit named it: checkpoint_<N> under the project's checkpoints/
    return removed


def latest_directory(project: Any) -> Path:
    """The newest whole automatic checkpoint, saying which newer ones it passed over and why; the
    next save continues the numbering after the highest number there (whole or not)."""
    root = _root(project, "load_state()")
    existing = _numbered(root)
    if not existing:
        raise CheckpointError(f"load_state() found no automatically named checkpoint (checkpoint_<N>) in {root}.")
    project.iteration = existing[-1][0] + 1
    skipped = []
    for _, directory in reversed(existing):
        if _whole(directory):
            if skipped:
                note(
                    f"load_state() resumes from {directory.name}, the newest whole checkpoint: passed over "
                    f"{', '.join(p.name for p in skipped)} (no {METADATA_FILE}: a save that never finished)."
                )
            return directory
        skipped.append(directory)
    raise CheckpointError(
        f"load_state() found no whole checkpoint in {root}: {', '.join(p.name for p in skipped)} "
        f"{'has' if len(skipped) == 1 else 'have'} no {METADATA_FILE} (saves that never finished)."
    )
