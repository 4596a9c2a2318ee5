"""The end-to-end check a launcher runs: the processes agree on who they are, the shared RNG,
how a dataloader is shared out (every sample once, in order, after ``gather_for_metrics``),
``split_between_processes``, early stopping's trigger, and that training over the processes
gives the weights one process gets on the whole batch. ``python -m lowbit.test_utils.scripts.test_script``."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lowbit import Accelerator
from lowbit.test_utils.training import RegressionDataset, RegressionModel

from lowbit.compat.utils import gather, set_seed, synchronize_rng_states


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def check_processes(accelerator: Accelerator) -> None:
    ranks = gather(torch.tensor([accelerator.process_index], device=accelerator.device)).tolist()
    _check(ranks == list(range(accelerator.num_processes)), f"the processes say they are {ranks}")
    _check(accelerator.is_main_process == (accelerator.process_index == 0), "is_main_process is rank 0's alone")


def check_rng(accelerator: Accelerator) -> None:
    torch.manual_seed(accelerator.process_index)  # different on purpose
    synchronize_rng_states(["torch"])
    draws = gather(torch.rand(1, device=accelerator.device)[None])
    _check(torch.equal(draws, draws[:1].expand_as(draws)), "synchronize_rng_states left the processes' RNGs apart")


def check_dataloader(accelerator: Accelerator, length: int) -> None:
    loader = accelerator.prepare(DataLoader(list(range(length)), batch_size=4))
    seen = torch.cat([accelerator.gather_for_metrics(batch.to(accelerator.device)) for batch in loader]).tolist()
    _check(seen == list(range(length)), f"gather_for_metrics over the dataloader gave {seen}")


def check_split(accelerator: Accelerator) -> None:
    items = list(range(7))
    with accelerator.split_between_processes(items) as mine:
        shares = accelerator.gather_for_metrics([mine], use_gather_object=True)
    _check([i for share in shares for i in share] == items, f"split_between_processes shared out {shares}")


def check_trigger(accelerator: Accelerator) -> None:
    if accelerator.is_last_process:
        accelerator.set_trigger()
    _check(accelerator.check_trigger(), "a trigger set on one process was not seen by every process")
    _check(not accelerator.check_trigger(), "check_trigger did not reset the trigger")


def check_training(accelerator: Accelerator) -> None:
    """Two optimizer steps over the processes' shares equal two steps on the whole batch here."""
    set_seed(42)
    data = RegressionDataset(length=8 * accelerator.num_processes, seed=42)
    whole = DataLoader(data, batch_size=8 * accelerator.num_processes)
    reference = RegressionModel()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in whole:
        loss = torch.nn.functional.mse_loss(reference(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    _check(
        torch.allclose(trained.a.cpu(), reference.a) and torch.allclose(trained.b.cpu(), reference.b),
        f"trained a={trained.a.item():.6f} b={trained.b.item():.6f}, one process on the whole batch gets "
        f"a={reference.a.item():.6f} b={reference.b.item():.6f}",
    )


def main() -> None:
    accelerator = Accelerator()
    for check in (check_processes, check_rng, check_split, check_trigger, check_training):
        check(accelerator)
    for length in (8, 9, 13):  # a round number of batches, and ones that need padding
        check_dataloader(Accelerator(), length)
    accelerator.print(f"test_script: every check passed on {accelerator.num_processes} process(es)")


if __name__ == "__main__":
    main()
