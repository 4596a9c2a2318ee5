"""Rank backends and choose one, keeping the reasons so the choice can be explained.

Ranking is explicit: higher ``priority`` wins, ties break by name, so the result never depends
on install order. A user's explicit choice always wins, and choosing a backend that is missing
or unusable is an error that says what was detected and what to install.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lowbit.kernel.errors import BackendNotFoundError, BackendUnavailableError, did_you_mean
from lowbit.kernel.first_party import FIRST_PARTY, first_party, fp8_install_hint, install_command

# The distributions lowbit publishes: a plugin of one of them keeps every name it answers to.
FIRST_PARTY_DISTRIBUTIONS = frozenset(distribution for distribution, _ in FIRST_PARTY.values())
from lowbit.kernel.manager import BrokenPlugin, LowbitPluginManager
from lowbit.kernel.types import (
    NATIVE_PRECISIONS,
    ROLES,
    BackendDescription,
    HardwareInfo,
    PluginDescription,
    normalize_name,
)


@dataclass
class Candidate:
    description: PluginDescription
    plugin: object

    @property
    def name(self) -> str:
        return self.description.name

    def matches(self, requested: str) -> bool:
        wanted = normalize_name(requested)
        return wanted in {normalize_name(n) for n in (self.name, *self.description.aliases)}


class PluginRegistry:
    """Every plugin the installed distributions describe (backends and strategies), for one hardware,
    with broken ones set aside."""

    def __init__(self, manager: LowbitPluginManager, hardware: HardwareInfo) -> None:
        self.manager = manager
        self.hardware = hardware
        self.candidates: list[Candidate] = []
        # Names claimed by several plugins of one role: (role, normalized name) -> the message that refuses them.
        self.conflicts: dict[tuple[str, str], str] = {}
        for plugin, description in manager.call_each("describe_backend", hardware=hardware):
            origin = manager.origin(plugin)
            problem = _contract_problem(description)
            if problem:
                manager.record_broken(
                    manager.get_name(plugin) or "?", origin.distribution, f"describe_backend: {problem}"
                )
                continue
            # Who a plugin is comes from the distribution that installed its entry point, not from
            # what it says of itself: a plugin claiming "lowbit-ao" must not pass for lowbit's own.
            installed = (manager.get_name(plugin) or "") in manager.origins
            description.distribution = (
                origin.distribution if installed else (description.distribution or origin.distribution)
            )
            description.version = origin.version if installed else (description.version or origin.version)
            self.candidates.append(Candidate(description, plugin))
        self._set_aside_duplicates()

    def _set_aside_duplicates(self) -> None:
        """Two plugins of one role claiming one name: a built-in one keeps it (a plugin shadowing
        lowbit's own "ddp" must not break every plain launch) and the other is set aside, named;
        otherwise neither is used (which one the user meant is unknowable), and asking for that
        name is an error naming both distributions. Every other name still works."""
        by_name: dict[tuple[str, str], list[Candidate]] = {}
        for cand in self.candidates:  # a name and every alias is a claim: an alias "ao" is lowbit-ao's name
            for claimed in {normalize_name(n) for n in (cand.name, *cand.description.aliases)}:
                by_name.setdefault((cand.description.ROLE, claimed), []).append(cand)
        for key, same in by_name.items():
            same = [c for c in same if c in self.candidates]  # one set aside for an earlier clash stays aside
            if len(same) < 2:
                continue
            built_in = [c for c in same if self.manager.get_name(c.plugin) in self.manager.builtin_names]
            own = built_in or [c for c in same if c.description.distribution in FIRST_PARTY_DISTRIBUTIONS]
            label = same[0].description.LABEL
            if own:  # lowbit's own plugin is never replaced by a namesake
                others = " and ".join(sorted(c.description.distribution or "?" for c in same if c not in own))
                whose = "lowbit's built-in one" if built_in else own[0].description.distribution
                message = (
                    f"its {label} answers to {key[1]!r}, as {whose}, which keeps the name; "
                    f"rename the plugin's ({others})"
                )
                built_in = own
                clashing = [c for c in same if c not in built_in]
            else:
                dists = " and ".join(sorted(c.description.distribution or "?" for c in same))
                message = f"{label} name {key[1]!r} is claimed by both {dists}; uninstall one of them"
                self.conflicts[key] = message
                clashing = same
            for cand in clashing:
                self.manager.record_broken(
                    self.manager.get_name(cand.plugin) or cand.name, cand.description.distribution, message
                )
                self.candidates.remove(cand)

    @classmethod
    def for_names(cls, manager: LowbitPluginManager) -> "PluginRegistry":
        """The installed plugins' descriptions, for the names they answer to (precisions,
        distributed types, sections, launch switches), without detecting hardware or importing
        torch: availability in it means nothing."""
        return cls(manager, HardwareInfo("cpu", "CPU"))

    def rule_out_under(self, strategy: str) -> None:
        """Backends that say they cannot run under ``strategy`` (``unusable_under``) become
        unavailable for this run, with their reason: the ranking passes over them, and naming one
        is an error before anything is prepared."""
        for cand in self.candidates:
            if not isinstance(cand.description, BackendDescription):
                continue
            reason = cand.description.unusable_under.get(strategy)
            if cand.description.available and reason:
                cand.description = dataclasses.replace(
                    cand.description, available=False, reason=f"not under the {strategy} strategy: {reason}"
                )

    def launch_switches(self) -> dict[str, str]:
        """``lowbit launch --<flag>`` switches the strategies declare -> the strategy's name."""
        return {c.description.launch_flag: c.name for c in self.ranked("strategy") if c.description.launch_flag}

    @property
    def broken(self) -> list[BrokenPlugin]:
        return self.manager.broken

    def ranked(self, role: str) -> list[Candidate]:
        """The plugins of ``role`` ("backend", "strategy": ``lowbit.kernel.types.ROLES``), best first."""
        same_role = [c for c in self.candidates if c.description.ROLE == role]
        return sorted(same_role, key=lambda c: (-c.description.priority, c.name))

    def find(self, role: str, requested: str) -> Candidate | None:
        return next((c for c in self.ranked(role) if c.matches(requested)), None)

    def strategy_for(self, distributed_type: str) -> Candidate | None:
        """The strategy a ``distributed_type`` value names: by name or alias, else by the types it
        declares it stands for (``StrategyDescription.distributed_types``), highest priority first."""
        wanted = normalize_name(distributed_type)
        ranked = self.ranked("strategy")
        return self.find("strategy", distributed_type) or next(
            (c for c in ranked if wanted in {normalize_name(t) for t in c.description.distributed_types}), None
        )

    def distributed_type_names(self) -> list[str]:
        """Every distributed_type value some installed strategy answers to."""
        names: list[str] = []
        for cand in self.ranked("strategy"):
            names += [*cand.description.distributed_types, cand.name]
        # A name two plugins claim is known too: choosing it is the error that names both.
        names += [name for role, name in self.conflicts if role == "strategy"]
        return list(dict.fromkeys(names))

    def precision_names(self) -> list[str]:
        """The mixed_precision names the installed low-precision backends serve ("fp8", "fp4", ...)."""
        return list(dict.fromkeys(p for c in self.ranked("backend") for p in c.description.precisions))

    def config_sections(self) -> list[str]:
        """The YAML sections the installed strategies read (``fsdp_config``, ...)."""
        return list(
            dict.fromkeys(c.description.config_section for c in self.ranked("strategy") if c.description.config_section)
        )


def _contract_problem(description: PluginDescription) -> str:
    if not isinstance(description.name, str) or not description.name:
        return f"name must be a non-empty string, got {description.name!r}"
    if not isinstance(description.priority, int) or isinstance(description.priority, bool):
        return f"priority must be an int, got {description.priority!r}"
    if not isinstance(description.reason, str):
        return f"reason must be a string, got {type(description.reason).__name__}"
    if not description.available and not description.reason:
        return "an unavailable plugin must say why (reason is empty)"
    return _backend_problem(description) if isinstance(description, BackendDescription) else ""


def _backend_problem(description: BackendDescription) -> str:
    if not isinstance(description.precisions, tuple) or not all(
        isinstance(p, str) and p for p in description.precisions
    ):
        return f"precisions must be a tuple of names, got {description.precisions!r}"
    if not isinstance(description.unusable_under, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in description.unusable_under.items()
    ):
        return f"unusable_under must map strategy names to reasons, got {description.unusable_under!r}"
    if not description.precisions:
        return "precisions may not be empty: name the mixed_precision values it trains in"
    if set(description.precisions) & NATIVE_PRECISIONS:
        native = ", ".join(sorted(NATIVE_PRECISIONS))
        return f"precisions may not claim the native ones ({native}), got {description.precisions!r}"
    return ""


@dataclass
class Selection:
    """The outcome of choosing the plugin of one role, with everything needed to explain it."""

    role: str
    chosen: Candidate | None
    requested: str | None
    source: str  # where the explicit request came from, or "ranking"
    ranked: list[Candidate]
    hardware: HardwareInfo
    broken: list[BrokenPlugin] = field(default_factory=list)

    @property
    def name(self) -> str | None:
        return self.chosen.name if self.chosen else None

    @property
    def label(self) -> str:
        return ROLES[self.role].LABEL

    def explain(self) -> str:
        """A few lines saying which backend was chosen and why each other one was not."""
        if self.chosen is None:
            head = f"No {self.label} chosen."
        elif self.requested:
            head = f"{self.label}: {self.chosen.name} (requested by {self.source})."
        else:
            head = f"{self.label}: {self.chosen.name} (highest priority available; ties break by name)."
        lines = [head, f"Hardware: {self.hardware.describe()}.", "Installed:"]
        for cand in self.ranked:
            d = cand.description
            if cand is self.chosen:
                status = "chosen"
            elif d.available:
                why = "" if self.chosen is None else " (not requested)" if self.requested else " (lower priority)"
                status = "available, not chosen" + why
            else:
                status = f"unavailable: {d.reason}"
            lines.append(f"  {d.name:<10} priority {d.priority:<4} {d.distribution or '-':<18} {status}")
        if not self.ranked:
            lines.append("  (none)")
        for b in self.broken:
            lines.append(f"  broken: {b.describe()}")
        return "\n".join(lines)


def _installed_summary(ranked: list[Candidate]) -> str:
    if not ranked:
        return "none"
    return "; ".join(f"{c.name} ({'available' if c.description.available else c.description.reason})" for c in ranked)


def _install_hint(role: str) -> str:
    return fp8_install_hint() if role == "backend" else ""


def choose_plugin(
    registry: PluginRegistry,
    role: str,
    requested: str | None = None,
    source: str = "ranking",
    precision: str | None = None,
) -> Selection:
    """Pick the plugin of ``role``: the requested one, or the best available one; for a
    low-precision ``precision`` ("fp8", "fp4", ...), among the backends that serve it.

    Raises BackendNotFoundError for a name nobody provides and BackendUnavailableError for a
    backend that cannot run here (or when nothing can), naming hardware and installed backends.
    """
    label = ROLES[role].LABEL
    ranked = [c for c in registry.ranked(role) if precision is None or precision in c.description.precisions]
    if precision is not None and requested and registry.find(role, requested) not in (None, *ranked):
        other = registry.find(role, requested)
        raise BackendUnavailableError(
            f"{label} {other.name!r} (from {source}) does not train in {precision!r}; it offers "
            f"{', '.join(other.description.precisions)}. Backends for {precision!r}: {_installed_summary(ranked)}."
        )
    hardware = registry.hardware
    clash = registry.conflicts.get((role, normalize_name(requested or "")))
    if clash:
        raise BackendUnavailableError(f"{label} {requested!r} (from {source}) cannot be used: {clash}.")
    if requested:
        cand = next((c for c in ranked if c.matches(requested)), None)
        if cand is None:
            wanted = normalize_name(requested)
            known = first_party(requested)
            if known and any(normalize_name(b.name) == wanted for b in registry.broken):
                broken = next(b for b in registry.broken if normalize_name(b.name) == wanted)
                raise BackendUnavailableError(f"{label} {requested!r} is installed but broken: {broken.error}")
            if known:
                raise BackendUnavailableError(
                    f"{label} {requested!r} (from {source}) is not installed: {install_command(known)}. "
                    f"Detected hardware: {hardware.describe()}. Installed {label}s: {_installed_summary(ranked)}."
                )
            names = [c.name for c in ranked] + list(FIRST_PARTY)
            raise BackendNotFoundError(
                f"Unknown {label} {requested!r} (from {source}).{did_you_mean(requested, names)} "
                f"Installed {label}s: {_installed_summary(ranked)}."
            )
        if not cand.description.available:
            others = [c.name for c in ranked if c.description.available]
            raise BackendUnavailableError(
                f"{label} {cand.name!r} (from {source}) is installed but cannot run here: {cand.description.reason}. "
                f"Detected hardware: {hardware.describe()}. "
                + (f"Available instead: {', '.join(others)}." if others else f"No {label} can run here.")
            )
        return Selection(role, cand, requested, source, ranked, hardware, list(registry.broken))
    available = [c for c in ranked if c.description.available]
    if not available:
        clashes = [message for (clash_role, _), message in registry.conflicts.items() if clash_role == role]
        if clashes:  # installed twice over: installing more would not help
            raise BackendUnavailableError(
                f"No usable {label}: " + "; ".join(clashes) + f". Detected hardware: "
                f"{hardware.describe()}. Other installed {label}s: {_installed_summary(ranked)}."
            )
        raise BackendUnavailableError(
            f"No usable {label}. Detected hardware: {hardware.describe()}. "
            f"Installed {label}s: {_installed_summary(ranked)}.{_install_hint(role)}"
        )
    return Selection(role, available[0], None, "ranking", ranked, hardware, list(registry.broken))
