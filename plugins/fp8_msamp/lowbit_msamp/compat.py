"""Can the installed torch, Transformer Engine and DeepSpeed run the installed MS-AMP?

Answered from package metadata alone (nothing imported): MS-AMP declares exact pins
(deepspeed==0.13.1, Transformer Engine from a 2023 git tag), and `import msamp` imports both, so
a mismatch means it fails in ``prepare()`` or later. lowbit reports MS-AMP unavailable instead,
with what is installed and what to change, so it never wins the ranking only to fail.
"""
from __future__ import annotations

import importlib.metadata
import re

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

# lowbit-deepspeed's own floor: with MS-AMP's DeepSpeed pin, the two cannot share an environment.
LOWBIT_DEEPSPEED_FLOOR = "0.14"


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_tag_version(url: str) -> Version | None:
    """The version a ``...git@v1.1`` requirement names, or None for other URLs."""
    match = re.search(r"@v?(\d+(?:\.\d+)*)$", url)
    return Version(match.group(1)) if match else None


def _advice(requirement: Requirement, wanted: str) -> str:
    if requirement.name.lower() == "deepspeed":
        return (f"`pip install \"deepspeed{wanted}\"` (lowbit-deepspeed needs deepspeed>={LOWBIT_DEEPSPEED_FLOOR}, "
                "so MS-AMP then runs in one process or under DDP, not under the DeepSpeed strategy)")
    if requirement.url:
        return f"`pip install \"{requirement.name} @ {requirement.url}\"`"
    return f"`pip install \"{requirement.name}{wanted}\"`"


def msamp_distribution() -> importlib.metadata.Distribution | None:
    """The distribution that installed the ``msamp`` package. MS-AMP's pyproject names it
    "MS-AMP" (0.4.0 and main), not "msamp", so it is found by the package it provides."""
    names = importlib.metadata.packages_distributions().get("msamp", []) + ["MS-AMP"]
    for name in names:
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def unmet_requirements() -> list[str]:
    """One sentence per requirement of the installed msamp distribution that is not met here.

    Empty when msamp has no distribution metadata (a source tree on the path): then only the
    import checks of ``unavailable_reason`` apply."""
    dist = msamp_distribution()
    if dist is None:
        return []
    problems = []
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an optional extra's requirement
        installed = _installed(requirement.name)
        wanted = str(requirement.specifier) or (f" from {requirement.url}" if requirement.url else "")
        if installed is None:
            problems.append(f"{requirement.name} is not installed (MS-AMP {dist.version} requires {requirement.name}"
                            f"{wanted}): {_advice(requirement, str(requirement.specifier))}")
            continue
        try:
            version = Version(installed)
        except InvalidVersion:
            continue
        if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"MS-AMP {dist.version} requires {requirement.name}{requirement.specifier}, installed "
                            f"{installed}: {_advice(requirement, str(requirement.specifier))}")
        elif requirement.url and (tag := _git_tag_version(requirement.url)) and tag.major != version.major:
            problems.append(f"MS-AMP {dist.version} requires {requirement.name} {tag} (from {requirement.url}), "
                            f"installed {installed}: {_advice(requirement, '')}")
    return problems
