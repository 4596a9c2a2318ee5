"""The prepared DataLoader as libraries meet it: the real size of a stream's last batch (what
gather_for_metrics keeps), and the loader being a torch DataLoader."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

from lowbit import Accelerator

from lowbit.runtime.training.data_loader import LoaderOptions, PreparedDataLoader


class Stream(IterableDataset):
    """``length`` numbers, of no known length."""

    def __init__(self, length: int):
        self.length = length

    def __iter__(self):
        return iter(torch.arange(float(self.length)))


def test_one_process_cuts_a_streams_last_batch_to_its_real_size_in_gather_for_metrics():
    """transformers' evaluation loop repeats each batch's loss to the eval batch size and gathers
    it for metrics: 66 samples in batches of 8 leave a last batch of 2, whose 8 repeated losses
    must count twice, not eight times (eval_loss was wrong, silently). Accelerate's dispatcher
    reports the last batch's own size; so does lowbit now."""
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(Stream(66), batch_size=8))
    kept = []
    for batch in loader:
        repeated_loss = batch.mean().repeat(8)  # Trainer: loss.repeat(eval_batch_size)
        kept.append(acc.gather_for_metrics(repeated_loss))
        if acc.gradient_state.end_of_dataloader:
            assert acc.gradient_state.remainder == 2
    assert [len(k) for k in kept] == [8] * 8 + [2]


def stream_share(num_workers: int) -> tuple[list[list[float]], int, bool]:
    """Rank 0's share of a 21-sample stream that each of 2 processes reads (dispatch_batches=False),
    in batches of 4: the batches, the remainder at the last one, and whether it was unknown."""
    loader = PreparedDataLoader(
        DataLoader(Stream(21), batch_size=4, num_workers=num_workers),
        torch.device("cpu"),
        num_processes=2,
        process_index=0,
        options=LoaderOptions(dispatch_batches=False),
    )
    batches, remainder = [], None
    for batch in loader:
        batches.append(batch.tolist())
        if loader.end_of_dataloader:
            remainder = loader.remainder
    return batches, remainder, loader.remainder_unknown


def test_a_stream_each_process_reads_knows_its_last_reads_real_samples_or_says_it_cannot():
    """Rounds of 8 samples: the last read holds 5 (16..20), filled up with the stream's first 3.
    Read in this process, the remainder is 5 (gather_for_metrics keeps the real ones); read by
    loader workers the count stays in them, so the remainder is -1 and the loader says it is unknown
    (gather_for_metrics warns, instead of returning the repeats as samples unsaid)."""
    batches, remainder, unknown = stream_share(num_workers=0)
    assert batches[-1] == [16.0, 17.0, 18.0, 19.0] and remainder == 5 and not unknown
    batches_in_workers, remainder, unknown = stream_share(num_workers=1)
    assert batches_in_workers == batches and remainder == -1 and unknown


def test_a_prepared_loader_is_a_dataloader_showing_the_users_loader_settings():
    """Libraries check ``isinstance(loader, DataLoader)`` and read ``sampler``, ``dataset``,
    ``num_workers`` off it (transformers' Trainer among them), as Accelerate's loaders allow."""
    import copy

    base = DataLoader(list(range(10)), batch_size=4, shuffle=True, num_workers=0)
    loader = Accelerator(cpu=True).prepare(base)
    assert isinstance(loader, DataLoader)
    assert loader.sampler is base.sampler and loader.batch_sampler is base.batch_sampler
    assert loader.dataset is base.dataset and loader.num_workers == 0 and loader.drop_last is False
    assert loader._index_sampler is base.batch_sampler and loader.multiprocessing_context is None
    assert len(loader) == 3 and sorted(x for batch in loader for x in batch.tolist()) == list(range(10))
    assert len(copy.copy(loader)) == 3


def test_a_loader_skipped_past_its_end_has_no_batches_left():
    """``len()`` of a loader resumed past its end (skip_first_batches beyond the epoch) is 0, as
    every other kind of prepared loader says; it raised ``__len__() should return >= 0``."""
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(list(range(10)), batch_size=4))
    skipped = acc.skip_first_batches(loader, 5)
    assert len(skipped) == 0 and list(skipped) == []


def test_a_prepared_loader_pickles_with_a_lambda_on_preemption_and_loads_the_same_batches():
    """The docs' own ``on_preemption(lambda: ...)`` made every prepared loader unpicklable (the
    preemption stop it holds): Accelerate's loaders pickle."""
    import pickle

    from lowbit import Accelerator

    acc = Accelerator(cpu=True)
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(16.0), batch_size=4))
    acc.on_preemption(lambda: acc.save_state("ckpt"))
    back = pickle.loads(pickle.dumps(loader))
    assert [b.tolist() for b in back] == [b.tolist() for b in loader]
