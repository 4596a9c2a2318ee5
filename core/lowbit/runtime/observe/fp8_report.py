"""One line that says what FP8 took in a prepared model, and why the other Linear layers stay in
high precision: the :class:`~lowbit.kernel.types.ConversionReport` the backend returned from
``convert_model``, in words."""

from __future__ import annotations

from lowbit.kernel.layer_roles import LayerRole
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
    roles = record.layer_roles
    frozen_kept = {n for n in skipped if roles is not None and roles.of(n) is LayerRole.FROZEN_BASE}
    total = len(converted) + len(skipped) - len(frozen_kept)
    noun, per_type = layer_kinds(record)
    label = ", ".join(part for part in (backend, record.recipe, "emulated" if runs == "emulated" else "") if part)
    adapters = len(roles.named(LayerRole.ADAPTER)) if roles is not None else 0
    trained = " trained" if adapters or record.frozen_low_precision or frozen_kept else ""
    parts = [f"{len(converted)} of {total}{trained} {noun} layers{per_type}"] if total or not trained else []
    parts.append(frozen_part(record, precision, len(frozen_kept)))
    line = f"{precision} ({label}): " + "; ".join(part for part in parts if part)
    if adapters:
        line += f"; {adapters} adapter layers kept in high precision"
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
    if not converted and not record.frozen_low_precision:
        line += (
            f". Nothing trains in {precision} (FP8 GEMMs need both dims divisible by 16, "
            "block formats by their block), and the first and last Linear are kept in high precision by default "
            "(keep_first_last_high_precision=False converts them too)"
        )
    return line + "."


def frozen_part(record: ConversionReport, precision: str, kept: int) -> str:
    """``13 of 14 frozen bases stored and run in fp8 (no weight-gradient GEMM; their weights 1.6 MB
    -> 0.4 MB)``, or '' when the model has no frozen layer in the backend's format."""
    frozen = record.frozen_low_precision
    if not frozen and not kept:
        return ""
    before, after = record.frozen_bytes
    sizes = f"; their weights {before / 2**20:.1f} MB -> {after / 2**20:.1f} MB" if before else ""
    return (
        f"{len(frozen)} of {len(frozen) + kept} frozen layers stored and run in {precision} "
        f"(no weight-gradient GEMM{sizes})"
    )


def converted_nothing(record: ConversionReport | None) -> bool:
    """The backend reported its conversion and no layer was converted (frozen layers included)."""
    return record is not None and not record.converted and not record.frozen_low_precision


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
