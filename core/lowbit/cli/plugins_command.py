"""``lowbit plugins``: what is installed, how it ranks, what would be chosen now, and why."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lowbit.kernel.types import BackendDescription, StrategyDescription


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--cpu", action="store_true", help="report as if training on CPU")
    parser.set_defaults(run=run)


def collect(cpu: bool = False) -> dict[str, Any]:
    """Everything ``lowbit plugins`` reports, as plain data."""
    from lowbit.kernel.errors import LowbitError
    from lowbit.kernel.manager import SLOW_IMPORT_SECONDS
    from lowbit.kernel.registry import PluginRegistry, choose_plugin

    from lowbit.run.plugin_manager import make_plugin_manager

    manager = make_plugin_manager()
    hardware = manager.detect_hardware(cpu=cpu)
    registry = PluginRegistry(manager, hardware)
    try:
        selection = choose_plugin(registry, "backend")
        chosen, why = selection.name, "highest priority available"
    except LowbitError as exc:
        chosen, why = None, str(exc)
    rows = []
    for role in ("backend", "strategy"):
        for cand in registry.ranked(role):
            d = cand.description
            rows.append(
                dict(
                    name=d.name,
                    distribution=d.distribution,
                    version=d.version,
                    role=role,
                    priority=d.priority,
                    status="available" if d.available else "unavailable",
                    reason=d.reason,
                    chosen=(d.name == chosen),
                    hooks=implemented_hooks(manager, cand.plugin),
                    libraries=list(d.libraries),
                    **_what_it_is(d, hardware),
                )
            )
    for b in registry.broken:
        rows.append(
            dict(
                name=b.name,
                distribution=b.distribution,
                version="",
                role="?",
                priority=None,
                status="broken",
                reason=b.error,
                chosen=False,
            )
        )
    load_seconds = {name: round(origin.load_seconds, 3) for name, origin in manager.origins.items()}
    slow = {name: s for name, s in load_seconds.items() if s > SLOW_IMPORT_SECONDS}
    return {
        "hardware": hardware.describe(),
        "backend_choice": chosen,
        "backend_choice_reason": why,
        "plugins": rows,
        "load_seconds": load_seconds,
        "slow_imports": slow,
    }


def _what_it_is(description: Any, hardware: Any) -> dict[str, Any]:
    """What a plugin says it is: the precisions and recipes a low-precision backend offers (and how
    this machine runs each); for a strategy, the distributed types that choose it, its config
    section, whether it owns precision, how its state is saved."""
    if isinstance(description, BackendDescription):
        from lowbit.kernel.recipe_names import recipe_rows

        return {"precisions": list(description.precisions), "recipes": recipe_rows(description, hardware)}
    if isinstance(description, StrategyDescription):
        return {
            "distributed_types": list(description.distributed_types),
            "config_section": description.config_section,
            "owns_precision": description.owns_precision,
            "launch_flag": description.launch_flag,
            "checkpoint": description.checkpoint,
        }
    return {}


def _described(row: dict[str, Any]) -> str:
    if "precisions" in row:
        from lowbit.kernel.recipe_names import describe_recipes

        recipes = describe_recipes(row["recipes"]) if row["status"] == "available" else ""
        return (
            "precisions: "
            + ", ".join(row["precisions"])
            + (
                f"; recipes here: {recipes}"
                if recipes
                else f"; recipes: {', '.join(r['recipe'] for r in row['recipes'])}"
                if row["recipes"]
                else "; one fixed recipe"
            )
        )
    if "distributed_types" in row:
        parts = ["distributed_type: " + " | ".join([*row["distributed_types"], row["name"]])]
        if row["config_section"]:
            parts.append(f"section {row['config_section']}")
        if row["launch_flag"]:
            parts.append(f"--{row['launch_flag']}")
        parts.append("owns precision" if row["owns_precision"] else "")
        parts.append(f"checkpoint: {row['checkpoint']}")
        return "; ".join(p for p in parts if p)
    return ""


def implemented_hooks(manager: Any, plugin: object) -> list[str]:
    """The hooks ``plugin`` implements, besides describe_backend (which every plugin has)."""
    return sorted(caller.name for caller in manager.get_hookcallers(plugin) or () if caller.name != "describe_backend")


def run(args: argparse.Namespace) -> int:
    report = collect(cpu=args.cpu)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"Hardware: {report['hardware']}")
    header = f"{'name':<10} {'role':<11} {'priority':>8}  {'status':<11} {'distribution':<20} {'version':<8} reason"
    print(header)
    print("-" * len(header))
    for row in report["plugins"]:
        mark = " *" if row["chosen"] else ""
        priority = "" if row["priority"] is None else row["priority"]
        print(
            f"{row['name'] + mark:<10} {row['role']:<11} {priority:>8}  {row['status']:<11} "
            f"{row['distribution'] or '-':<20} {row['version'] or '-':<8} {row['reason']}"
        )
    print("\nWhat each plugin is:")
    for row in report["plugins"]:
        if _described(row):
            print(f"  {row['name']:<10} {_described(row)}")
    print("\nHooks each plugin implements (docs/writing-a-backend.md):")
    for row in report["plugins"]:
        if row.get("hooks") is not None:
            print(f"  {row['name']:<10} {', '.join(row['hooks']) or '-'}")
    for name, seconds in report["slow_imports"].items():
        print(
            f"\nslow plugin: {name!r} took {seconds:.2f} s to import; every lowbit command pays for it "
            "(a plugin's entry module should import its backend library lazily)."
        )
    if report["backend_choice"]:
        print(f"\nmixed_precision='fp8' would use: {report['backend_choice']} (*), {report['backend_choice_reason']}.")
    else:
        print(f"\nmixed_precision='fp8' would fail here: {report['backend_choice_reason']}")
    return 0
