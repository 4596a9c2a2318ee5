"""Writing a file all or nothing: into a temp file beside it, flushed to disk, then renamed over it
(``os.replace`` is atomic), so a crash at any instant leaves the old file or the new one. Every
file lowbit writes goes through here: checkpoints, model files, config files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

# A writer's temp file: ``<name>.lowbit-tmp`` beside the file.
TMP_SUFFIX = ".lowbit-tmp"


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """``write(handle)`` into ``path`` via its temp file; the temp file is removed if anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
