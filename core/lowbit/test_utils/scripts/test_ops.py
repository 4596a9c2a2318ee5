"""The collective operations (gather, gather_object, broadcast, pad_across_processes, reduce) give
every process what they promise. ``python -m lowbit.test_utils.scripts.test_ops`` under a launcher."""

from __future__ import annotations

import torch

from lowbit.compat.state import PartialState
from lowbit.compat.utils import broadcast, gather, gather_object, pad_across_processes, reduce


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"process {PartialState().process_index}: {what}")


def main() -> None:
    state = PartialState()
    world, rank = state.num_processes, state.process_index
    mine = torch.tensor([rank * 2.0, rank * 2.0 + 1], device=state.device)
    _check(
        gather(mine).tolist() == [float(i) for i in range(2 * world)],
        "gather joins every process's tensor in rank order",
    )
    _check(gather_object([rank]) == list(range(world)), "gather_object joins every process's list in rank order")
    sent = broadcast(torch.full((3,), float(rank), device=state.device), from_process=0)
    _check(sent.tolist() == [0.0] * 3, "broadcast gives every process the main process's tensor")
    ragged = torch.ones(rank + 1, 2, device=state.device)
    padded = pad_across_processes(ragged, dim=0)
    _check(
        padded.shape == (world, 2) and padded[rank + 1 :].abs().sum() == 0,
        "pad_across_processes pads to the longest with 0",
    )
    first = pad_across_processes(ragged, dim=0, pad_index=-1, pad_first=True)
    _check(first[: world - rank - 1].eq(-1).all() and first[world - rank - 1 :].eq(1).all(), "pad_first pads in front")
    total = reduce(torch.tensor([rank + 1.0], device=state.device), reduction="sum")
    _check(total.item() == world * (world + 1) / 2, "reduce('sum') adds every process's tensor")
    mean = reduce(torch.tensor([rank + 1.0], device=state.device), reduction="mean")
    _check(abs(mean.item() - (world + 1) / 2) < 1e-6, "reduce('mean') averages them")
    state.print("test_ops: every operation checked on", world, "process(es)")


if __name__ == "__main__":
    main()
