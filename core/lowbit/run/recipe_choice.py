"""Choosing the low-precision backend for a precision and, when the user named one, a recipe.

Without a backend named, the ranking picks among the available backends that offer the recipe
(or, with no recipe named, their default recipe for the precision): first those whose hardware
runs it natively, then those that emulate it, each by priority. So ``recipe="mxfp8"`` maps to
whichever installed backend implements MXFP8, and a CPU still trains through emulation.
A named backend that lacks the recipe, or hardware that cannot run it, is an error naming the
backends that have it and the hardware it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.kernel.errors import BackendUnavailableError, ConfigError
from lowbit.kernel.first_party import FIRST_PARTY_BACKENDS, install_command
from lowbit.kernel.recipe_names import declared_recipes, default_recipe, known_recipes, recipe_status
from lowbit.kernel.registry import Candidate, PluginRegistry, Selection, choose_plugin


@dataclass
class RecipeChoice:
    """The recipe a run trains with: its name (None: the backend has one fixed recipe), and how
    the chosen hardware runs it ("native" or "emulated")."""

    name: str | None
    status: str = "native"


def check_recipe_precision(registry: PluginRegistry, recipe: str, recipe_source: str, precision: str) -> None:
    """A recipe trains in one precision: ``nvfp4`` under ``mixed_precision="fp8"`` is a mistake."""
    info = known_recipes(c.description for c in registry.ranked("backend")).get(recipe)
    if info is not None and info.precision != precision:
        raise ConfigError(
            f"recipe {recipe!r} (from {recipe_source}) trains in {info.precision!r} ({info.summary}), but "
            f"mixed_precision is {precision!r}. Set mixed_precision={info.precision!r}, or pick a {precision} recipe "
            f"({', '.join(n for n, i in known_recipes().items() if i.precision == precision) or 'none known'})."
        )


def choose_with_recipe(
    registry: PluginRegistry, precision: str, requested: str | None, source: str, recipe: str | None, recipe_source: str
) -> tuple[Selection, RecipeChoice]:
    """The backend and recipe for this run (see the module docstring)."""
    if recipe is not None:
        check_recipe_precision(registry, recipe, recipe_source, precision)
    if requested:
        selection = choose_plugin(registry, "backend", requested, source, precision=precision)
        return selection, _recipe_on(selection.chosen, registry, precision, recipe, recipe_source)
    ranked = [c for c in registry.ranked("backend") if precision in c.description.precisions]
    offering = [c for c in ranked if recipe is None or recipe in declared_recipes(c.description)]
    if recipe is not None and not offering:
        raise BackendUnavailableError(
            f"No installed backend offers recipe {recipe!r} (from {recipe_source}). " + _who_offers(registry, recipe)
        )
    usable = [c for c in offering if c.description.available]
    if usable:
        statuses = [(c, _status(c, registry, precision, recipe)) for c in usable]
        for wanted in ("native", "emulated"):
            for cand, status in statuses:
                if status == wanted:
                    return (
                        Selection("backend", cand, None, "ranking", ranked, registry.hardware, list(registry.broken)),
                        RecipeChoice(_effective(cand, precision, recipe), status),
                    )
        cand, problem = statuses[0]
        raise BackendUnavailableError(
            f"{problem}. {_who_offers(registry, recipe or _effective(cand, precision, None))}"
        )
    # Nothing usable: choose_plugin words the error (hardware, installed backends, what to install).
    selection = choose_plugin(registry, "backend", None, "ranking", precision=precision)
    return selection, _recipe_on(selection.chosen, registry, precision, recipe, recipe_source)


def _effective(cand: Candidate, precision: str, recipe: str | None) -> str | None:
    return recipe or default_recipe(cand.description, precision)


def _status(cand: Candidate, registry: PluginRegistry, precision: str, recipe: str | None) -> str:
    name = _effective(cand, precision, recipe)
    return "native" if name is None else recipe_status(cand.description, name, registry.hardware)


def _recipe_on(
    cand: Candidate, registry: PluginRegistry, precision: str, recipe: str | None, recipe_source: str
) -> RecipeChoice:
    """The named backend must offer the recipe, and this hardware must run it (natively or emulated)."""
    description = cand.description
    if recipe is not None and recipe not in declared_recipes(description):
        offers = ", ".join(declared_recipes(description)) or "one fixed recipe, nothing to choose"
        raise BackendUnavailableError(
            f"recipe {recipe!r} (from {recipe_source}) is not offered by the {cand.name!r} backend "
            f"(it offers: {offers}). " + _who_offers(registry, recipe)
        )
    name = _effective(cand, precision, recipe)
    if name is None:
        return RecipeChoice(None)
    status = recipe_status(description, name, registry.hardware)
    if status not in ("native", "emulated"):
        raise BackendUnavailableError(
            f"{status} (backend {cand.name!r}). " + _who_offers(registry, name, emulating=True)
        )
    return RecipeChoice(name, status)


def _who_offers(registry: PluginRegistry, recipe: str, emulating: bool = False) -> str:
    """Which backends offer ``recipe``: installed ones with how they run it here, then the
    first-party ones that are not installed (with the install command)."""
    installed = {c.name: c for c in registry.ranked("backend")}
    statuses = {
        name: (
            recipe_status(c.description, recipe, registry.hardware)
            if c.description.available
            else "unavailable: " + c.description.reason
        )
        for name, c in installed.items()
        if recipe in declared_recipes(c.description)
    }
    if emulating and "emulated" in statuses.values():
        statuses = {name: status for name, status in statuses.items() if status == "emulated"}
    here = [f"{name} ({status})" for name, status in statuses.items()]
    elsewhere = [
        f"{backend} ({install_command(backend)})" for backend in FIRST_PARTY_BACKENDS if backend not in installed
    ]
    parts = []
    if here:
        parts.append(f"Installed backends offering {recipe!r}: {'; '.join(here)}.")
    if elsewhere:
        parts.append(
            f"Backends not installed here, which may offer it (`lowbit plugins` lists each one's recipes once "
            f"installed): {'; '.join(elsewhere)}."
        )
    return " ".join(parts) or f"No known backend offers {recipe!r}."
