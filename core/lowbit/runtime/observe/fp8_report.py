"""One line that says what FP8 took in a prepared model, and why the other Linear layers stay in
high precision: the :class:`~lowbit.kernel.types.ConversionReport` the backend returned from
``convert_model``, in words."""

from __future__ import annotations

from lowbit.kernel.types import ConversionReport

SHOWN_SKIPPED = 4  # the report names this many kept layers, then counts the rest


def conversion_report(
    record: ConversionReport | None, backend: str, precision: str = "fp8", runs: str = "native"
) -> str | None:
    """``fp8 (ao, tensorwise, emulated): 4 of 6 Linear layers; kept high precision: 0 (first
    Linear ...), ...``, or None when the backend recorded nothing (it converts the model its own
    way). The recipe is the one the backend reported; ``runs`` is "emulated" where the hardware
    has no GEMMs for it."""
    if record is None:
        return None
    converted, skipped = record.converted, record.skipped
    total = len(converted) + len(skipped)
    noun, per_type = layer_kinds(record)
    label = ", ".join(part for part in (backend, record.recipe, "emulated" if runs == "emulated" else "") if part)
    line = f"{precision} ({label}): {len(converted)} of {total} {noun} layers{per_type}"
    if skipped:
        kept = [f"{name or '<model>'} ({why})" for name, why in list(skipped.items())[:SHOWN_SKIPPED]]
        more = len(skipped) - SHOWN_SKIPPED
        line += "; kept high precision: " + ", ".join(kept) + (f", and {more} more" if more > 0 else "")
    if record.padding:
        line += "; " + record.padding
    if record.gathered_low_precision is not None:
        line += f"; weights all-gathered in {precision}: {len(record.gathered_low_precision)} of {len(converted)}"
    if record.predicted:
        line += "; " + record.predicted
    if not converted:
        line += (
            f". Nothing trains in {precision} (FP8 GEMMs need both dims divisible by 16, "
            "block formats by their block), and the first and last Linear are kept in high precision by default "
            "(keep_first_last_high_precision=False converts them too)"
        )
    return line + "."


def converted_nothing(record: ConversionReport | None) -> bool:
    """The backend reported its conversion and no layer was converted."""
    return record is not None and not record.converted


def layer_kinds(record: ConversionReport) -> tuple[str, str]:
    """The layers' type name and, when a model mixes types, the count per type:
    ``("Conv1D/Linear", " (Conv1D 22 of 24, Linear 0 of 1)")``."""
    types = record.layer_types
    kinds = sorted(set(types.values()))
    if len(kinds) <= 1:
        return (kinds[0] if kinds else "Linear"), ""
    converted = set(record.converted)
    counts = ", ".join(
        f"{kind} {sum(1 for n, t in types.items() if t == kind and n in converted)} of "
        f"{sum(1 for t in types.values() if t == kind)}"
        for kind in kinds
    )
    return "/".join(kinds), f" ({counts})"
