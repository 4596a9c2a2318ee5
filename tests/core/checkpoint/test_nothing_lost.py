"""Round 7 of "nothing lost": automatic checkpoints are pruned only once their successor is whole,
``load_state()`` takes the newest whole one, a refused save changes nothing on disk, and a reader
never removes what a live writer is staging."""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import fractions
import os
import signal
import subprocess
import sys
from pathlib import Path, PureWindowsPath

import pytest
import torch
from torch import nn

from lowbit import Accelerator
from lowbit.utils import ProjectConfiguration

from lowbit.kernel.errors import CheckpointError

from lowbit.runtime.checkpoint import files


def automatic(tmp_path: Path, total_limit: int):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit)
    acc = Accelerator(project_config=config, cpu=True)
    return acc, acc.prepare(nn.Linear(2, 2)), config


def fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        model.weight.fill_(value)


def names(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "checkpoints").iterdir())


class Unsaveable:
    """A registered object whose state lowbit refuses to write (an arbitrary object)."""

    def state_dict(self):
        return {"handle": object()}

    def load_state_dict(self, state):
        pass


def test_a_refused_save_prunes_nothing_and_the_only_checkpoint_stays(tmp_path):
    acc, model, _ = automatic(tmp_path, total_limit=1)
    fill(model, 1.0)
    acc.save_state()
    acc.register_for_checkpointing(Unsaveable())
    with pytest.raises(Exception, match="registered object 0"):
        acc.save_state()
    assert names(tmp_path) == ["checkpoint_0"]
    again, model, _ = automatic(tmp_path, total_limit=1)  # a restart (the refused object not registered)
    again.load_state()
    assert torch.all(model.weight == 1.0)


def test_a_save_that_fails_half_way_keeps_every_checkpoint_and_load_takes_the_newest_whole(tmp_path, monkeypatch):
    acc, model, config = automatic(tmp_path, total_limit=1)
    fill(model, 1.0)
    acc.save_state()
    fill(model, 2.0)
    real = files.write_file_atomically
    calls = []

    def dies_on_the_second_file(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill would, half-way through the save
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(files, "write_file_atomically", dies_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        acc.save_state()
    monkeypatch.setattr(files, "write_file_atomically", real)
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_1"]  # total_limit=1, and the old one is still there
    fill(model, 0.0)
    with pytest.warns(UserWarning, match=r"resumes from checkpoint_0.*passed over checkpoint_1 \(no lowbit_state"):
        acc.load_state()
    assert torch.all(model.weight == 1.0) and config.iteration == 2
    acc.save_state()  # numbering goes on past the unfinished one, which is pruned with the old once this is whole
    assert names(tmp_path) == ["checkpoint_2"]


KILLED_SAVE = Path(__file__).resolve().parents[2] / "scripts" / "killed_automatic_save.py"


def test_a_sigkill_inside_an_automatically_named_save_leaves_a_resumable_checkpoint(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(KILLED_SAVE), str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]  # nothing pruned before it was whole
    acc, model, config = automatic(tmp_path, total_limit=2)
    with pytest.warns(UserWarning, match="passed over checkpoint_2"):
        acc.load_state()
    assert torch.all(model.weight == 1.0) and config.iteration == 3


def test_a_load_during_another_jobs_save_leaves_its_staged_files_and_says_so(tmp_path):
    directory = tmp_path / "ckpt"
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 2))
    acc.save_state(directory)
    staging = directory / files.STAGING_DIR
    staging.mkdir()
    (staging / "model_0.pt").write_bytes(b"being written")
    lock = files._lock_for_saving(directory)  # the live writer holds the directory's lock
    try:
        with pytest.raises(CheckpointError, match="a save_state is writing into that directory right now"):
            acc.load_state(directory)
        assert (staging / "model_0.pt").read_bytes() == b"being written"
    finally:
        os.close(lock)
    acc.load_state(directory)  # the writer gone (its lock with it): the leftovers are recovered, the load works
    assert not staging.exists()


class Color(enum.IntEnum):
    RED = 1


class Mode(str, enum.Enum):
    TRAIN = "train"


Point = collections.namedtuple("Point", "x y")


def every_kind_of_value() -> dict:
    """What registered objects' states hold in real scripts: each must come back as itself."""
    import numpy as np

    return {
        "int": 3,
        "float": 0.5,
        "str": "s",
        "bool": True,
        "none": None,
        "bytes": b"x",
        "complex": 1 + 2j,
        "list": [1, "a"],
        "tuple": (1, 2),
        "dict": {"a": 1},
        "ordered": collections.OrderedDict(b=2, a=1),
        "set": {1, 2},
        "frozenset": frozenset({"a"}),
        "np_float64": np.float64(0.25),
        "np_float32": np.float32(0.5),
        "np_int64": np.int64(7),
        "np_bool": np.bool_(True),
        "np_str": np.str_("word"),
        "ndarray": np.arange(4),
        "int_enum": Color.RED,
        "str_enum": Mode.TRAIN,
        "defaultdict": collections.defaultdict(list, {"k": [1]}),
        "counter": collections.Counter("aab"),
        "deque": collections.deque([1, 2], maxlen=5),
        "namedtuple": Point(1, 2),
        "path": Path("/data/run"),
        "windows_path": PureWindowsPath("C:/runs/7"),
        "range": range(0, 10, 2),
        "datetime": datetime.datetime(2026, 11, 29, 1, 2, 3),
        "timedelta": datetime.timedelta(days=1, seconds=5),
        "decimal": decimal.Decimal("1.10"),
        "fraction": fractions.Fraction(1, 3),
        "frozenset_key": {frozenset({1}): "k"},
    }


class Keeper:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_every_type_a_registered_state_holds_round_trips_as_itself(tmp_path):
    import numpy as np

    saved = every_kind_of_value()
    acc = Accelerator(cpu=True)
    acc.register_for_checkpointing(Keeper(saved))
    acc.save_state(tmp_path / "ckpt")
    loaded = Keeper({})
    other = Accelerator(cpu=True)
    other.register_for_checkpointing(loaded)
    other.load_state(tmp_path / "ckpt")
    assert list(loaded.state) == list(saved)
    for key, value in saved.items():
        got = loaded.state[key]
        assert type(got) is type(value), (key, type(got), type(value))
        same = np.array_equal(got, value) if isinstance(value, np.ndarray) else got == value
        assert same, (key, got, value)
    assert loaded.state["defaultdict"]["new"] == [] and loaded.state["deque"].maxlen == 5


def test_a_defaultdict_whose_factory_is_code_is_refused_before_anything_is_written(tmp_path):
    acc = Accelerator(cpu=True)
    acc.register_for_checkpointing(Keeper({"d": collections.defaultdict(lambda: 0)}))
    with pytest.raises(CheckpointError, match="default_factory .* is not a built-in type"):
        acc.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def crafted_checkpoint(tmp_path: Path, state) -> Path:
    """A checkpoint whose registered state is ``state`` as written on disk (its checksum updated to
    match, as a crafted file's would be)."""
    import json

    directory = tmp_path / "ckpt"
    acc = Accelerator(cpu=True)
    acc.register_for_checkpointing(Keeper({"a": 1}))
    acc.save_state(directory)
    path = directory / "custom_checkpoint_0.pt"
    torch.save(state, path)
    metadata = json.loads((directory / files.METADATA_FILE).read_text())
    metadata["files"][path.name] = files.sha256_of(path)
    (directory / files.METADATA_FILE).write_text(json.dumps(metadata))
    return directory


def deeply_nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return {"deep": value}


@pytest.mark.parametrize(
    "state, said",
    [
        ({"x": {"__lowbit_value__": "pickle", "value": 1}}, r"state\['x'\] holds an unknown tagged value 'pickle'"),
        ({"x": {"__lowbit_value__": "numpy", "dtype": "|O", "value": 1}}, r"dtype '\|O', which lowbit never writes"),
        ({"x": {"__lowbit_value__": "set"}}, r"state\['x'\] holds a malformed 'set' value \(KeyError"),
        ({"x": {"__lowbit_value__": "range", "value": "abc"}}, r"malformed 'range' value"),
        ({"x": {"__lowbit_value__": "counter", "items": [1, 2]}}, r"items are not \(key, value\) pairs"),
        ({"x": {"__lowbit_value__": "enum", "class": "os:system", "value": "ls"}}, r"class os:system, which is not"),
        (deeply_nested(150), r"nested more than 100 levels deep"),
    ],
)
def test_a_crafted_registered_state_is_refused_naming_the_file_and_the_entry(tmp_path, state, said):
    directory = crafted_checkpoint(tmp_path, state)
    keeper = Keeper({})
    acc = Accelerator(cpu=True)
    acc.register_for_checkpointing(keeper)
    with pytest.raises(CheckpointError, match=said) as caught:
        acc.load_state(directory)
    assert "custom_checkpoint_0.pt" in str(caught.value) or "class os:system" in str(caught.value)
    assert keeper.state == {}  # nothing was loaded
