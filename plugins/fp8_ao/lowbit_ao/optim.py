"""FP8 (or 8-bit) Adam states with torchao's low-bit optimizers: O2-style memory without MS-AMP."""

from __future__ import annotations

import torch

from lowbit.kernel.plugin_api import UnsupportedCombinationError

# (states, optimizer class) -> torchao.optim class name
LOW_BIT_CLASSES = {
    ("fp8", torch.optim.AdamW): "AdamWFp8",
    ("fp8", torch.optim.Adam): "AdamFp8",
    ("8bit", torch.optim.AdamW): "AdamW8bit",
    ("8bit", torch.optim.Adam): "Adam8bit",
}
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
# Implementation switches of torch's Adam that torchao's optimizers do not take.
TORCH_ONLY_KEYS = {"foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"}


def to_low_bit_optimizer(optimizer: torch.optim.Optimizer, states: str) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` as torchao's low-bit equivalent, keeping hyperparameters, param
    groups (with any extra keys, e.g. a scheduler's ``initial_lr``) and existing state."""
    base = type(optimizer)
    if base is torch.optim.Adam and optimizer.defaults.get("decoupled_weight_decay"):
        base = torch.optim.AdamW
    name = LOW_BIT_CLASSES.get((states, base))
    if name is None:
        raise UnsupportedCombinationError(
            f"optimizer_states={states!r} converts torch.optim.AdamW and torch.optim.Adam only; got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. Use one of those, or "
            "optimizer_states='default'."
        )
    if any(group.get("maximize") for group in optimizer.param_groups):
        raise UnsupportedCombinationError(f"torchao's {name} cannot maximize; the optimizer has maximize=True.")
    from lowbit_ao.quiet_import import import_torchao

    import_torchao()
    import torchao.optim

    cls = getattr(torchao.optim, name)
    groups = [{k: v for k, v in group.items() if k not in TORCH_ONLY_KEYS} for group in optimizer.param_groups]
    defaults = {k: optimizer.defaults[k] for k in HYPERPARAMETERS if k in optimizer.defaults}
    low_bit = cls(groups, **defaults)
    for param, old in optimizer.state.items():
        if old:
            low_bit.state[param] = _convert_state(low_bit, param, old)
    return low_bit


def _convert_state(low_bit: torch.optim.Optimizer, param: torch.Tensor, old: dict) -> dict:
    new = {"step": torch.as_tensor(old["step"], dtype=torch.float32).clone()}
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
        if key in old:
            buffer = low_bit._new_buffer(param, signed)
            buffer.copy_(old[key])
            new[key] = buffer
    return new
