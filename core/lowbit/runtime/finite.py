"""Whether a tensor holds NaN or inf, for every floating dtype lowbit meets: the checkpoint's
refusal of NaN weights and the NaN replay's account of where one began both ask it."""

from __future__ import annotations

import torch


def nonfinite(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor (this rank's shard of a DTensor) holds NaN or inf. FP8 data and
    UE8M0 scales (a frozen FP8 base's) are checked widened: torch has no isfinite for them."""
    local = tensor.to_local() if callable(getattr(tensor, "to_local", None)) else tensor
    if not local.is_floating_point() or not local.numel():
        return False
    local = local.detach()
    if local.element_size() == 1:
        local = local.float()
    return not bool(torch.isfinite(local).all())
