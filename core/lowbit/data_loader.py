"""Accelerate's ``accelerate.data_loader`` path: what ``prepare`` makes of a DataLoader, and
``skip_first_batches``. (``DataLoaderShard`` and ``DataLoaderDispatcher`` are both lowbit's
``PreparedDataLoader``: every process loads its own share.)"""
from lowbit.training.data_loader import PreparedDataLoader, skip_first_batches
from lowbit.utils import synchronize_rng_states

DataLoaderShard = DataLoaderDispatcher = PreparedDataLoader

__all__ = ["DataLoaderShard", "DataLoaderDispatcher", "PreparedDataLoader", "skip_first_batches", "synchronize_rng_states"]
