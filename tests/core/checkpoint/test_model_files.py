"""save_model writes what Accelerate writes: the same file names, sharding and index, readable by
Accelerate's own loader and by transformers."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TiedLM, mlp
from safetensors.torch import load_file
from torch import nn

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError

from lowbit.runtime.checkpoint.model_files import parse_size


def test_save_model_writes_the_files_accelerate_writes(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    model = mlp()
    ours, theirs = tmp_path / "lowbit", tmp_path / "accelerate"
    Accelerator(cpu=True).save_model(model, ours)
    accelerate.Accelerator(cpu=True).save_model(model, theirs)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) == ["model.safetensors"]
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_save_matches_accelerate_and_loads_with_its_loader(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    model = mlp()
    ours, theirs = tmp_path / "lowbit", tmp_path / "accelerate"
    path = Accelerator(cpu=True).save_model(model, ours, max_shard_size="10KB")
    accelerate.Accelerator(cpu=True).save_model(model, theirs, max_shard_size="10KB")
    assert path.name == "model.safetensors.index.json"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    index = json.loads(path.read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    fresh = mlp(seed=9)
    accelerate.utils.load_checkpoint_in_model(fresh, str(path))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_a_smaller_save_removes_the_earlier_shards_and_index_only(tmp_path):
    acc = Accelerator(cpu=True)
    model = mlp()
    (tmp_path / "notes.txt").write_text("mine")
    acc.save_model(model, tmp_path, max_shard_size="10KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    acc.save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]


def test_tied_weights_are_written_once_and_tie_again_on_load(tmp_path):
    model = TiedLM()
    with pytest.warns(UserWarning, match=r"head.weight \(same storage as embed.weight\)"):
        path = Accelerator(cpu=True).save_model(model, tmp_path)
    state = load_file(path)
    assert "head.weight" not in state and "embed.weight" in state
    fresh = TiedLM()
    nn.init.zeros_(fresh.embed.weight)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert missing == ["head.weight"] and not unexpected
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_torch_format_when_safe_serialization_is_off(tmp_path):
    model = mlp()
    path = Accelerator(cpu=True).save_model(model, tmp_path, safe_serialization=False)
    assert path.name == "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_bad_shard_size_and_file_target_are_clear_errors(tmp_path):
    assert parse_size("10GB") == 10 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(123) == 123
    with pytest.raises(ConfigError, match="max_shard_size must be"):
        Accelerator(cpu=True).save_model(mlp(), tmp_path, max_shard_size="ten gigs")
    target = tmp_path / "weights.bin"
    target.write_bytes(b"keep")
    with pytest.raises(ConfigError, match="is a file"):
        Accelerator(cpu=True).save_model(mlp(), target)
    assert target.read_bytes() == b"keep"


def _load_indexed(directory) -> dict[str, torch.Tensor]:
    """What a sharded loader (transformers' included) reads: the index's weight map, file by file."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / name))
    assert set(out) == set(index["weight_map"]), "the index names tensors its files do not hold"
    return out


@pytest.mark.parametrize("killed_after", range(0, 7))
def test_a_sharded_save_killed_at_any_point_leaves_a_complete_set(tmp_path, monkeypatch, killed_after):
    """The index always names one complete set: the previous one until the new one is whole."""
    from lowbit.runtime.checkpoint import model_files

    acc = Accelerator(cpu=True)
    old = acc.prepare(mlp(seed=1))
    acc.save_model(old, tmp_path, max_shard_size="10KB")
    before = _load_indexed(tmp_path)
    new = acc.prepare(mlp(seed=2))
    calls = {"n": 0}
    real_write, real_json = model_files.write_file_atomically, model_files.write_json_atomically

    def dying(write):
        def wrapped(*args, **kwargs):
            if calls["n"] == killed_after:
                raise KeyboardInterrupt("killed mid-save")
            calls["n"] += 1
            return write(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(model_files, "write_file_atomically", dying(real_write))
    monkeypatch.setattr(model_files, "write_json_atomically", dying(real_json))
    try:
        acc.save_model(new, tmp_path, max_shard_size="10KB")
        finished = True
    except KeyboardInterrupt:
        finished = False
    loaded = _load_indexed(tmp_path)
    expected = {k: v.detach() for k, v in acc.unwrap_model(new).state_dict().items()} if finished else before
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected), "a mix of two saves"
    monkeypatch.setattr(model_files, "write_file_atomically", real_write)
    monkeypatch.setattr(model_files, "write_json_atomically", real_json)
    acc.save_model(new, tmp_path, max_shard_size="10KB")  # the next save completes and cleans up
    assert not (tmp_path / model_files.PREVIOUS_SET_DIR).exists()
    assert all(
        torch.equal(_load_indexed(tmp_path)[k], v.detach()) for k, v in acc.unwrap_model(new).state_dict().items()
    )
