"""Can the installed torch, Transformer Engine and DeepSpeed run the installed MS-AMP?

Answered from package metadata alone (nothing imported): MS-AMP declares exact pins
(deepspeed==0.13.1, Transformer Engine from a 2023 git tag), and `import msamp` imports both, so
a mismatch means it fails in ``prepare()`` or later. lowbit reports MS-AMP unavailable instead,
with what is installed and what to change, so it never wins the ranking only to fail.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from lowbit.kernel.plugin_api import installed_version

# lowbit-deepspeed's own floor: with MS-AMP's DeepSpeed pin, the two cannot share an environment.
LOWBIT_DEEPSPEED_FLOOR = "0.14"


def _git_tag_version(url: str) -> Version | None:
    """The version a ``...git@v1.1`` requirement names, or None for other URLs."""
    match = re.search(r"@v?(\d+(?:\.\d+)*)$", url)
    return Version(match.group(1)) if match else None


def _advice(requirement: Requirement, wanted: str) -> str:
    if requirement.name.lower() == "deepspeed":
        return (
            f"`pip install \"deepspeed{wanted}\"` (lowbit-deepspeed needs deepspeed>={LOWBIT_DEEPSPEED_FLOOR}, "
            "so MS-AMP then runs in one process or under DDP, not under the DeepSpeed strategy)"
        )
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
        installed = installed_version(requirement.name)
        wanted = str(requirement.specifier) or (f" from {requirement.url}" if requirement.url else "")
        if installed is None:
            problems.append(
                f"{requirement.name} is not installed (MS-AMP {dist.version} requires {requirement.name}"
                f"{wanted}): {_advice(requirement, str(requirement.specifier))}"
            )
            continue
        try:
            version = Version(installed)
        except InvalidVersion:
            continue
        if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
            problems.append(
                f"MS-AMP {dist.version} requires {requirement.name}{requirement.specifier}, installed "
                f"{installed}: {_advice(requirement, str(requirement.specifier))}"
            )
        elif requirement.url and (tag := _git_tag_version(requirement.url)) and tag.major != version.major:
            problems.append(
                f"MS-AMP {dist.version} requires {requirement.name} {tag} (from {requirement.url}), "
                f"installed {installed}: {_advice(requirement, '')}"
            )
    return problems


# What MS-AMP's DeepSpeed integration takes from DeepSpeed's engine module: the top-level import
# of msamp/deepspeed/runtime/engine.py (v0.4.0 and main, the same list), used when the installed
# msamp's own file cannot be read (e.g. a zipped install).
MSAMP_DEEPSPEED_ENGINE_IMPORTS = (
    "SparseTensor",
    "ZERO_OPTIMIZATION",
    "AMP",
    "amp",
    "FP16",
    "BFLOAT16",
    "logger",
    "DeepSpeedEngine",
    "instrument_w_nvtx",
    "log_dist",
    "see_memory_usage",
    "DummyOptim",
    "DeepSpeedZeroOptimizer",
    "DeepSpeedZeRoOffload",
    "PipelineModule",
    "ZeroStageEnum",
)
ENGINE_MODULE = "deepspeed.runtime.engine"


def _package_file(package: str, relative: str) -> Path | None:
    """A file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.is_file():
            return path
    return None


def _imported_from_engine(source: str) -> list[str]:
    return [
        alias.name
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and node.module == ENGINE_MODULE
        for alias in node.names
    ]


def _module_level_names(source: str) -> set[str] | None:
    """The names a module binds when it is imported (top level, inside if/try/with too); None when a
    star import makes them unknowable from the source."""
    names: set[str] = set()
    pending = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                pending.extend(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    return names


@functools.cache
def deepspeed_integration_problem() -> str:
    """Why ``import msamp.deepspeed`` (MS-AMP under the DeepSpeed strategy) fails with the installed
    DeepSpeed, or '' when it should import. Read from both packages' sources; nothing imported.

    MS-AMP's engine imports Apex AMP's ``AMP``/``amp`` (and more) from ``deepspeed.runtime.engine``;
    DeepSpeed removed its Apex AMP integration (deepspeed/runtime/config.py 0.19.x: "NVIDIA Apex AMP
    integration has been removed"), and MS-AMP pins deepspeed==0.13.1, below lowbit-deepspeed's floor."""
    engine = _package_file("deepspeed", "runtime/engine.py")
    if engine is None:
        return ""  # no DeepSpeed: the strategy itself cannot be chosen, and says so
    msamp_engine = _package_file("msamp", "deepspeed/runtime/engine.py")
    wanted = _imported_from_engine(msamp_engine.read_text()) if msamp_engine else list(MSAMP_DEEPSPEED_ENGINE_IMPORTS)
    bound = _module_level_names(engine.read_text())
    missing = [name for name in wanted if bound is not None and name not in bound]
    if not missing:
        return ""
    dist = msamp_distribution()
    return (
        f"MS-AMP{' ' + dist.version if dist else ''}'s DeepSpeed integration (msamp.deepspeed) imports "
        f"{', '.join(missing)} from {ENGINE_MODULE}, which the installed deepspeed "
        f"{installed_version('deepspeed') or '?'} "
        "no longer has (DeepSpeed removed its Apex AMP integration); MS-AMP pins deepspeed==0.13.1 and "
        f"lowbit-deepspeed needs deepspeed>={LOWBIT_DEEPSPEED_FLOOR}, so no install that meets both runs them "
        "together. Under DeepSpeed use backend 'te' or 'ao' (FP8 with ZeRO 1-3); MS-AMP runs in one process or "
        "under DDP"
    )
