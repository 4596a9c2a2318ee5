"""Accelerate's automatic checkpoint naming: ``save_state()`` with no directory under
``ProjectConfiguration(automatic_checkpoint_naming=True)`` writes
``<project_dir>/checkpoints/checkpoint_<iteration>``, keeps the newest ``total_limit`` of them, and
``load_state()`` with no directory reads the newest."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from lowbit.kernel.errors import CheckpointError, ConfigError

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


def next_directory(project: Any, is_main_process: bool) -> Path:
    """The directory of the next automatic checkpoint; the main process removes the oldest ones
    so that, with the new one, ``total_limit`` remain. Advances ``project.iteration``."""
    root = _root(project, "save_state()")
    directory = root / f"checkpoint_{project.iteration}"
    if directory.exists():
        raise CheckpointError(
            f"{directory} exists already: ProjectConfiguration(iteration={project.iteration}) would "
            "overwrite it. Resume with load_state() (it sets the iteration after the newest) or "
            "choose another project_dir."
        )
    if is_main_process and project.total_limit is not None:
        existing = _numbered(root)
        for _, old in existing[: max(len(existing) + 1 - project.total_limit, 0)]:
            shutil.rmtree(old)  # lowbit named it: checkpoint_<N> under the project's checkpoints/
    project.iteration += 1
    return directory


def latest_directory(project: Any) -> Path:
    """The newest automatic checkpoint; the next save continues the numbering after it."""
    root = _root(project, "load_state()")
    existing = _numbered(root)
    if not existing:
        raise CheckpointError(f"load_state() found no automatically named checkpoint (checkpoint_<N>) in {root}.")
    number, directory = existing[-1]
    project.iteration = number + 1
    return directory
