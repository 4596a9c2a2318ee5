"""Accelerate's ``accelerate.data_loader`` path: the data-loading building blocks
(:mod:`lowbit.training.loader_shards`) and lowbit's prepared dataloader, which
``accelerator.prepare`` returns (each process reads its own share, and ``save_state`` records
where it is)."""
from lowbit.training.data_loader import PreparedDataLoader
from lowbit.training.loader_shards import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from lowbit.utils import synchronize_rng_states

__all__ = ["BatchSamplerShard", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin", "IterableDatasetShard",
           "PreparedDataLoader", "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "prepare_data_loader",
           "skip_first_batches", "synchronize_rng_states"]
