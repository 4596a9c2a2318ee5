"""The one walk over nested data (batches, model outputs, call arguments) that does not rebuild it.

``operations.recursively_apply`` rebuilds a nest with each tensor replaced; this only reads it.
Below the runtime's folders: the meter, the work counter, the NaN diagnosis and the
collectives all walk batches with it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def leaves(data: Any) -> Iterator[Any]:
    """Every leaf of a nest, in order: the one walk over batches, outputs and arguments that does not
    rebuild them (``recursively_apply`` does). Dicts, lists, tuples (named too) and mapping-likes
    (transformers' ModelOutput, BatchEncoding) are walked into; everything else is a leaf."""
    if isinstance(data, dict) or (
        hasattr(data, "keys") and hasattr(data, "__getitem__") and not isinstance(data, torch.Tensor)
    ):
        for key in data.keys():
            yield from leaves(data[key])
    elif isinstance(data, (list, tuple)):
        for item in data:
            yield from leaves(item)
    else:
        yield data


def tensor_leaves(data: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nest, in order (:func:`leaves`)."""
    return (leaf for leaf in leaves(data) if isinstance(leaf, torch.Tensor))
