"""Round 7 of "nothing lost": automatic checkpoints are pruned only once their successor is whole,
``load_state()`` takes the newest whole one, a refused save changes nothing on disk, and a reader
never removes what a live writer is staging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
