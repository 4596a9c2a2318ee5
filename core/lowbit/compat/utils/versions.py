"""Accelerate's ``accelerate.utils.versions`` path: compare an installed library's version."""

from __future__ import annotations

import operator

from lowbit.kernel.version import installed_version

_OPERATIONS = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def compare_versions(library_or_version: str, operation: str, requirement_version: str) -> bool:
    """``library_or_version`` (a distribution's name, or a version) ``operation`` ``requirement_version``."""
    from packaging.version import Version

    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {', '.join(_OPERATIONS)}, got {operation!r}.")
    installed = installed_version(library_or_version) if not library_or_version[:1].isdigit() else library_or_version
    if installed is None:
        raise ValueError(f"{library_or_version} is not installed.")
    return _OPERATIONS[operation](Version(installed), Version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """The installed torch ``operation`` ``version`` (local build tags like ``+cpu`` ignored)."""
    import torch
    from packaging.version import Version

    return _OPERATIONS[operation](Version(Version(torch.__version__).base_version), Version(version))
