"""Versions: lowbit's own (its installed distribution's; pyproject.toml says it once), and how any
installed distribution's version is read and compared, for every plugin alike (``packaging``'s
rules: "2.10" is newer than "2.9", "0.13.0+cu126" is 0.13.0)."""

from __future__ import annotations

import importlib.metadata

from packaging.version import InvalidVersion, Version

# The torch versions lowbit's CI runs its tests under (.ci/run's lanes; the oldest is every
# distribution's floor in its pyproject.toml): the CPU build the suite runs on, the version the
# GPU image ships and the newest release (their registry builds, which run on a CPU).
TESTED_TORCH = ("2.13.0", "2.11.0", "2.15.0")


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` from its metadata (nothing is imported), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def older_than(version: str, minimum: str) -> bool:
    """Whether ``version`` is below ``minimum`` (local labels and dev builds aside); False when
    ``version`` cannot be read, so an unusual build is trusted rather than refused."""
    try:
        return Version(version).release < Version(minimum).release
    except InvalidVersion:
        return False


def __getattr__(name: str) -> str:
    # lowbit's own version, read from metadata only when asked (20 ms).
    if name == "__version__":
        return installed_version("lowbit") or "0+unknown"  # a source tree on the path, not installed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
