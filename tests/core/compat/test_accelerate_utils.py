"""lowbit's versions of Accelerate utilities that its own test suite does not cover on a CPU, or
that lowbit does its own way (tests/accelerate_suite runs Accelerate's tests for the rest)."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from helpers import mlp

from lowbit import Accelerator
from lowbit.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class
from lowbit.utils import compile_regions, load_checkpoint_in_model, merge_fsdp_weights, purge_accelerate_environment

from lowbit.kernel.errors import ConfigError, UnsupportedCombinationError


def test_a_pickled_or_copied_prepared_optimizer_still_steps():
    model = mlp()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for clone in (pickle.loads(pickle.dumps(optimizer)), copy.deepcopy(optimizer)):
        params = [p for group in clone.param_groups for p in group["params"]]
        for p in params:
            p.grad = torch.ones_like(p)
        before = params[0].detach().clone()
        clone.step()
        assert torch.allclose(params[0], before - 0.1) and not clone.step_was_skipped


def test_compile_regions_returns_a_twin_and_leaves_the_model_as_it_is():
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]), torch.nn.Linear(4, 2))
    twin = compile_regions(model, backend="eager")
    assert twin is not model and twin._orig_mod is model
    assert all(type(block).__name__ == "OptimizedModule" for block in twin[0])
    assert all(isinstance(block, torch.nn.Linear) for block in model[0])  # the original is untouched
    assert twin[0][0]._orig_mod.weight is model[0][0].weight  # one set of weights
    assert "_orig_mod" not in twin.state_dict() and set(twin[1].state_dict()) == {"weight", "bias"}
    assert Accelerator(cpu=True).unwrap_model(twin, keep_torch_compile=False) is model


def test_load_checkpoint_in_model_loads_what_save_model_wrote_and_refuses_placement(tmp_path):
    accelerator = Accelerator(cpu=True)
    saved = mlp()
    accelerator.save_model(saved, tmp_path, max_shard_size="2KB")  # several shards and their index
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    fresh = mlp()
    load_checkpoint_in_model(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()))
    with pytest.raises(UnsupportedCombinationError, match="device_map.*Use Accelerate's"):
        load_checkpoint_in_model(fresh, tmp_path, device_map="auto")


def test_merge_fsdp_weights_writes_a_sharded_save_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = mlp()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "sharded"), no_dist=True)
    merge_fsdp_weights(tmp_path / "sharded", tmp_path / "whole")
    fresh = mlp()
    load_checkpoint_in_model(fresh, tmp_path / "whole", strict=True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


class _Recorder(GeneralTracker):
    name = "lowbit_test_recorder"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.values: dict = {}

    def log(self, values, step=None, **kwargs):
        self.values.update(values)


@pytest.fixture
def tracker_registry():
    saved = dict(LOGGER_TYPE_TO_CLASS)
    yield LOGGER_TYPE_TO_CLASS
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(saved)


def test_a_registered_tracker_class_is_nameable_in_log_with(tracker_registry):
    register_tracker_class(_Recorder)
    assert tracker_registry["lowbit_test_recorder"] is _Recorder
    accelerator = Accelerator(cpu=True, log_with="lowbit_test_recorder")
    accelerator.init_trackers("run")
    accelerator.log({"loss": 1.5}, step=0)
    assert accelerator.get_tracker("lowbit_test_recorder").values == {"loss": 1.5}
    with pytest.raises(ConfigError, match="requires_logging_directory"):
        register_tracker_class(type("Nameless", (GeneralTracker,), {}))


def test_purge_accelerate_environment_hides_launcher_variables_and_puts_them_back(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("LOWBIT_MIXED_PRECISION", "bf16")

    @purge_accelerate_environment
    def inside():
        os.environ["ACCELERATE_LEFT_BEHIND"] = "1"
        return Accelerator(cpu=True).mixed_precision

    assert inside() == "no"  # the launcher's precision was not seen
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16" and "ACCELERATE_LEFT_BEHIND" not in os.environ


def test_accelerate_torch_device_names_the_device(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert Accelerator(cpu=True).device == torch.device("cpu")


def test_save_model_of_weights_not_in_memory_is_refused_before_a_file_is_written(tmp_path):
    import types

    from lowbit import init_empty_weights

    with init_empty_weights():
        empty = mlp()
    offloaded = mlp()
    offloaded[0]._hf_hook = types.SimpleNamespace(offload=True)  # as a device_map dispatch leaves it
    for model, what in ((empty, "meta device"), (offloaded, "offloaded by a device_map hook")):
        with pytest.raises(UnsupportedCombinationError, match=f"not all in memory.*{what}.*save_pretrained"):
            Accelerator(cpu=True).save_model(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_datasets_stream_with_a_shard_per_process_is_split_by_its_own_shards():
    """A Hugging Face stream with at least one shard per process: each process reads its own shards
    (Accelerate's native sharding), not the whole stream keeping every N-th batch."""
    datasets = pytest.importorskip("datasets")
    from torch.utils.data import DataLoader

    from lowbit.data_loader import IterableDatasetShard, prepare_data_loader

    stream = datasets.Dataset.from_dict({"x": list(range(10))}).to_iterable_dataset(num_shards=2)
    seen = []
    for rank in range(2):
        loader = prepare_data_loader(
            DataLoader(stream, batch_size=4), num_processes=2, process_index=rank, dispatch_batches=False
        )
        assert not isinstance(loader.dataset, IterableDatasetShard)
        seen.append([x for batch in loader for x in batch["x"].tolist()])
    assert sorted(seen[0] + seen[1]) == list(range(10)) and not set(seen[0]) & set(seen[1])
    single = prepare_data_loader(
        DataLoader(stream, batch_size=4), num_processes=3, process_index=0, dispatch_batches=False
    )
    assert isinstance(single.dataset, IterableDatasetShard), "fewer shards than processes: every N-th batch"
