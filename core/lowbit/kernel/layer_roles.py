"""Which role each Linear layer of a model plays, decided once per model at ``prepare()``.

Every low-precision backend, the FP8 report and ``explain`` read the same answer, so a LoRA run is
described one way everywhere. The roles:

- ``adapter``: a trainable adapter's own small Linear (PEFT's ``lora_A``/``lora_B``, ``lora_embedding_*``
  and the other tuners' adapter layers). Rank-16 GEMMs gain nothing from FP8 and the adapter's
  weights are what the run trains: never converted.
- ``fp8_published``: a layer whose weight is already stored in FP8 with its scales (transformers'
  ``FP8Linear`` as a Qwen3-FP8 or DeepSeek-style checkpoint loads it). Used with its own scales.
- ``frozen_base``: a Linear whose weight needs no gradient (a LoRA base layer, a frozen tower). In
  FP8 it is quantized once and runs two GEMMs a step (forward, input gradient), none for the weight.
- ``trained``: every other Linear: full FP8 training (three GEMMs, a weight gradient).

Adapters are found without importing PEFT: a PEFT tuner layer names the attributes holding its
adapters in ``adapter_layer_names`` (``peft.tuners.tuners_utils.BaseTunerLayer``, PEFT 0.7 to 0.21).
Importing this module never imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    import torch


class LayerRole(str, enum.Enum):
    ADAPTER = "adapter"
    FP8_PUBLISHED = "fp8-published"
    FROZEN_BASE = "frozen base"
    TRAINED = "trained"


@dataclass(frozen=True)
class LayerRoles:
    """A model's Linear-like layers (by qualified name, in module order) and the role of each."""

    roles: Mapping[str, LayerRole]

    def of(self, name: str) -> LayerRole:
        return self.roles.get(name, LayerRole.TRAINED)

    def named(self, role: LayerRole) -> list[str]:
        return [name for name, r in self.roles.items() if r is role]

    @property
    def has_adapters(self) -> bool:
        return any(r is LayerRole.ADAPTER for r in self.roles.values())

    def counts(self) -> dict[str, int]:
        """``{"adapter": 28, "frozen base": 14, ...}``, roles with no layer left out."""
        out: dict[str, int] = {}
        for role in self.roles.values():
            out[role.value] = out.get(role.value, 0) + 1
        return out


def is_float8(tensor: "torch.Tensor | None") -> bool:
    """A tensor stored in one of torch's 8-bit float formats (e4m3, e5m2 and their variants)."""
    return tensor is not None and tensor.dtype.is_floating_point and tensor.element_size() == 1


def adapter_modules(model: "torch.nn.Module") -> set[int]:
    """The ids of every module that belongs to a PEFT tuner's adapters (found by the tuner layer's
    own ``adapter_layer_names``), descendants included."""
    found: set[int] = set()
    for module in model.modules():
        names = getattr(type(module), "adapter_layer_names", None)
        if not isinstance(names, (tuple, list)):
            continue
        for attribute in names:
            holder = getattr(module, attribute, None)
            if hasattr(holder, "modules"):
                found.update(id(m) for m in holder.modules())
    return found


def is_linear_like(module: "torch.nn.Module") -> bool:
    """``nn.Linear`` and its subclasses (transformers' ``FP8Linear`` among them), and transformers'
    ``Conv1D`` (GPT-2's Linear with its weight transposed), found by name so transformers stays unimported."""
    import torch

    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def classify_layers(model: "torch.nn.Module", candidates: Iterable[str] | None = None) -> LayerRoles:
    """The role of every layer in ``candidates`` (default: every Linear-like layer), in module order."""
    wanted = set(candidates) if candidates is not None else None
    adapters = adapter_modules(model)
    roles: dict[str, LayerRole] = {}
    for name, module in model.named_modules():
        if (name not in wanted) if wanted is not None else not is_linear_like(module):
            continue
        weight = getattr(module, "weight", None)
        if id(module) in adapters:
            roles[name] = LayerRole.ADAPTER
        elif is_float8(weight):
            roles[name] = LayerRole.FP8_PUBLISHED
        elif weight is not None and not weight.requires_grad:
            roles[name] = LayerRole.FROZEN_BASE
        else:
            roles[name] = LayerRole.TRAINED
    return LayerRoles(roles)
