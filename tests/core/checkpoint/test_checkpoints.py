"""save_state / load_state: exact resume, and never losing data (issue: reliability).

Faults are injected for real: a save SIGKILLed at every step of its commit (in a forked child),
a full disk (a small tmpfs when this machine lets us mount one, else RLIMIT_FSIZE), flipped
bytes, edited metadata, files that lowbit did not write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import manager_with, mlp, regression_data
from torch import nn

from lowbit import Accelerator, hookimpl
from lowbit.cli.self_test import train_steps

from lowbit.kernel.errors import CheckpointError, ConfigError
from lowbit.kernel.types import BackendDescription

from lowbit.runtime.checkpoint import files as checkpoint
from lowbit.runtime.checkpoint.files import METADATA_FILE, RETIRED_DIR, STAGING_DIR, CheckpointNote


def _prepared(seed=0, mixed_precision="no"):
    acc = Accelerator(mixed_precision=mixed_precision, plugin_manager=manager_with())
    model = mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def train(acc, model, opt, steps, sched=None):
    x, y = regression_data(64)
    return train_steps(acc, model, opt, x, y, steps, scheduler=sched)


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_weights(model, expected):
    return all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())


def rewrite_metadata(directory, edit):
    path = directory / METADATA_FILE
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(edit(meta)))


# ---------------------------------------------------------------------- exact resume


def test_save_and_load_state_resume_exactly(tmp_path):
    acc, model, opt, sched = _prepared()
    train(acc, model, opt, 3, sched)
    acc.save_state(tmp_path / "ckpt")
    expected = train(acc, model, opt, 3, sched)
    acc2, model2, opt2, sched2 = _prepared(seed=9)
    acc2.load_state(tmp_path / "ckpt")
    assert train(acc2, model2, opt2, 3, sched2) == expected


def test_every_rng_is_restored(tmp_path):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    draws = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(100), random.random(), np.random.rand(7)  # move every generator on
    acc.load_state(tmp_path / "ckpt")
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1] == again[1] and draws[2] == again[2]


def test_grad_scaler_state_is_saved_and_restored(tmp_path):
    acc, model, opt, _ = _prepared(mixed_precision="fp16")
    train(acc, model, opt, 1)
    acc.scaler.update(new_scale=1024.0)
    acc.save_state(tmp_path / "ckpt")
    acc.scaler.update(new_scale=8.0)
    acc.load_state(tmp_path / "ckpt")
    assert acc.scaler.get_scale() == 1024.0


def test_registered_objects_round_trip_and_must_match(tmp_path):
    from helpers import Counter

    acc, *_ = _prepared()
    counter = Counter()
    acc.register_for_checkpointing(counter)
    counter.n = 7
    acc.save_state(tmp_path / "ckpt")
    counter.n = 0
    acc.load_state(tmp_path / "ckpt")
    assert counter.n == 7
    other, *_ = _prepared()
    with pytest.raises(CheckpointError, match="holds 1 object.*registered 0"):
        other.load_state(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="Item at index 0 is a object"):
        acc.register_for_checkpointing(object())


def test_checkpoint_from_another_setup_is_refused(tmp_path):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    other, *_ = _prepared(mixed_precision="bf16")
    with pytest.raises(CheckpointError, match=r"mixed_precision='no'.*this run uses mixed_precision='bf16'"):
        other.load_state(tmp_path / "ckpt")


# ---------------------------------------------------------------------- files lowbit did not write


def test_save_state_into_a_run_directory_keeps_every_other_file(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out").write_bytes(b"events")
    (run / "train_log.txt").write_text("epoch 1\n")
    (run / "model.pt").write_bytes(b"user weights")
    acc, model, opt, sched = _prepared()
    acc.save_state(run)
    train(acc, model, opt, 2, sched)
    acc.save_state(run)  # replaces lowbit's previous checkpoint, and only it
    assert (run / "tensorboard" / "events.out").read_bytes() == b"events"
    assert (run / "train_log.txt").read_text() == "epoch 1\n"
    assert (run / "model.pt").read_bytes() == b"user weights"
    assert not (run / STAGING_DIR).exists() and not (run / RETIRED_DIR).exists()
    acc2, model2, *_ = _prepared(seed=4)
    acc2.load_state(run)
    assert same_weights(model2, weights(model))


def test_a_user_file_with_a_checkpoint_name_is_never_overwritten(tmp_path):
    (tmp_path / "model_0.pt").write_bytes(b"mine")
    acc, *_ = _prepared()
    with pytest.raises(CheckpointError, match="would overwrite model_0.pt.*did not write"):
        acc.save_state(tmp_path)
    assert (tmp_path / "model_0.pt").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_0.pt"]


def test_current_directory_and_a_file_are_refused(tmp_path, monkeypatch):
    acc, *_ = _prepared()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="current directory"):
        acc.save_state(".")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        acc.save_state("notes.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------- damaged checkpoints


def test_a_flipped_byte_is_an_error_naming_the_file(tmp_path):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "model_0.pt"
    data = bytearray(target.read_bytes())
    data[len(data) - 200] ^= 0x40  # inside the tensor data: torch.load alone would not notice
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model_0.pt' is corrupted"):
        acc.load_state(tmp_path / "ckpt")


def test_truncated_checkpoint_file_gets_a_clear_error(tmp_path):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "optimizer_0.pt"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"optimizer_0.pt' is corrupted"):
        acc.load_state(tmp_path / "ckpt")


def test_a_missing_rng_file_is_an_error(tmp_path):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "rng_state_0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rng_state_0.pt' is missing"):
        acc.load_state(tmp_path / "ckpt")
    rewrite_metadata(
        tmp_path / "ckpt", lambda m: {**m, "files": {k: v for k, v in m["files"].items() if "rng" not in k}}
    )
    with pytest.raises(CheckpointError, match=r"has no rng_state_0.pt"):
        acc.load_state(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: [m], "expected a JSON object, found a list"),
        (lambda m: {**m, "step": "3"}, r"'step' should be an int from 0 to \d+, found '3'"),
        (
            lambda m: {**m, "step": 10**30},
            r"'step' should be an int from 0 to 9223372036854775807, found 1000000000000000000000000000000",
        ),
        (lambda m: {**m, "step": -1}, r"'step' should be an int from 0 to \d+, found -1"),
        (lambda m: {**m, "world_size": 10**30}, r"'world_size' should be an int from 1 to 16777216, found 10{30}"),
        (lambda m: {**m, "world_size": 0}, r"'world_size' should be an int from 1 to 16777216, found 0"),
        (lambda m: {**m, "custom_objects": -2}, r"'custom_objects' should be an int from 0"),
        (lambda m: {**m, "strategy_checkpoint": 1}, r"'strategy_checkpoint' should be bool"),
        (lambda m: {**m, "dataloader_epochs": {"a": 1}}, r"'dataloader_epochs' should be a list of ints"),
        (lambda m: {**m, "dataloader_epochs": [-1]}, r"'dataloader_epochs' should be a list of ints from 0"),
        (lambda m: {**m, "files": ["model_0.pt"]}, r"'files' should be mapping"),
        (lambda m: {**m, "stpe": 3}, r"unknown key\(s\) 'stpe'"),
        (lambda m: {k: v for k, v in m.items() if k != "files"}, r"missing key\(s\) files"),
    ],
)
def test_tampered_metadata_is_an_error(tmp_path, edit, message):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    rewrite_metadata(tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=message):
        acc.load_state(tmp_path / "ckpt")


def test_not_a_checkpoint_gets_a_clear_error(tmp_path):
    acc, *_ = _prepared()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="lowbit_state.json is missing"):
        acc.load_state(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="does not exist"):
        acc.load_state(tmp_path / "nowhere")


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    acc, *_ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "model_0.pt"
    torch.save({"weights": os.system}, target)  # would run code if unpickled freely
    digest = hashlib.sha256(target.read_bytes()).hexdigest()  # even with a matching checksum
    rewrite_metadata(tmp_path / "ckpt", lambda m: {**m, "files": {**m["files"], "model_0.pt": digest}})
    with pytest.raises(CheckpointError, match="cannot be read"):
        acc.load_state(tmp_path / "ckpt")


# ---------------------------------------------------------------------- crashes mid-save


def _count_replaces_in_one_save(acc, directory):
    calls = []
    real = os.replace

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    os.replace = counting
    try:
        acc.save_state(directory)
    finally:
        os.replace = real
    return len(calls)


def _save_killed_at(acc, directory, kill_at):
    """Fork a child that saves and SIGKILLs itself just before its ``kill_at``-th os.replace."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            count = [0]
            real = os.replace

            def dying(*args, **kwargs):
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)

            os.replace = dying
            acc.save_state(directory)
        finally:
            os._exit(3)  # reached only if the kill never came
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path):
    acc, model, opt, sched = _prepared()
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.txt").write_text("mine")
    acc.save_state(run)
    old = weights(model)
    train(acc, model, opt, 2, sched)
    new = weights(model)
    replaces = _count_replaces_in_one_save(acc, tmp_path / "probe")
    commit_point = replaces  # the metadata's move into place is the last os.replace of a save
    outcomes = []
    for kill_at in range(1, replaces + 1):
        acc.save_state(run)  # start each trial from a committed checkpoint of `new`
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(old[name])
        acc.save_state(run)  # ... then of `old`; the killed save writes `new` again
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(new[name])
        assert _save_killed_at(acc, run, kill_at), f"the save was not killed at os.replace #{kill_at}"
        fresh, fresh_model, *_ = _prepared(seed=5)
        with warnings_as_list() as notes:
            fresh.load_state(run)
        loaded_new = same_weights(fresh_model, new)
        assert loaded_new or same_weights(fresh_model, old), f"killed at #{kill_at}: a mix of two checkpoints"
        assert loaded_new == (kill_at > commit_point), f"killed at #{kill_at}"
        assert (run / "train_log.txt").read_text() == "mine"
        assert not (run / STAGING_DIR).exists() and not (run / RETIRED_DIR).exists()
        outcomes.append((kill_at, "new" if loaded_new else "old", bool(notes)))
    assert any(noted for *_, noted in outcomes), "no interrupted save was reported"


@contextlib.contextmanager
def warnings_as_list():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointNote)
        yield caught


# ---------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def small_disk(tmp_path, size_kib):
    """A directory on a filesystem of ``size_kib`` KiB (tmpfs), or, where mounting is not allowed,
    a process file-size limit of the same size (writes then fail with EFBIG instead of ENOSPC)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        == 0
    )
    if mounted:
        try:
            yield mount, None
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size_kib * 1024, hard))

    try:
        yield mount, limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    acc, model, opt, sched = _prepared()
    with small_disk(tmp_path, 1024) as (disk, limit):
        acc.save_state(disk / "ckpt")
        old = weights(model)
        train(acc, model, opt, 2, sched)
        if limit is None:  # tmpfs: fill it up, leaving less than one model file of room
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            (disk / "filler").write_bytes(b"\0" * max(free - 16 * 1024, 0))
        else:
            limit()
        with pytest.raises(CheckpointError, match="disk is full"):
            acc.save_state(disk / "ckpt")
        assert not (disk / "ckpt" / STAGING_DIR).exists()
        fresh, fresh_model, *_ = _prepared(seed=5)
        fresh.load_state(disk / "ckpt")
        assert same_weights(fresh_model, old)


def test_torchs_writer_failure_is_recognised_as_a_full_disk():
    assert checkpoint.is_disk_full(RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64"))
    assert checkpoint.is_disk_full(OSError(28, "No space left on device"))
    assert not checkpoint.is_disk_full(RuntimeError("something else"))
    assert "disk is full" in checkpoint.disk_full_message(
        tempfile.gettempdir() and __import__("pathlib").Path(tempfile.gettempdir()) / "x"
    )


class StatefulBackend:
    """An FP8 backend whose state dicts need encoding (a value torch.load(weights_only) refuses)
    and which keeps state outside them: the four checkpoint hooks, routed to it alone."""

    def __init__(self):
        self.restored = None

    @hookimpl
    def describe_backend(self, hardware):
        return BackendDescription("stateful", 500, True)

    @hookimpl
    def convert_model(self, model, context):
        model.scales = {"w": torch.tensor([2.0])}  # outside the state dict
        return model

    @hookimpl
    def encode_checkpoint_state(self, kind, owner, state, context):
        return {"encoded": {**state, "opaque": None}} if kind == "model" else None

    @hookimpl
    def decode_checkpoint_state(self, kind, owner, state, context):
        if kind != "model":
            return None
        assert set(state) == {"encoded"}
        return {k: v for k, v in state["encoded"].items() if k != "opaque"}

    @hookimpl
    def backend_checkpoint_state(self, model, context):
        return {"scales": model.scales}

    @hookimpl
    def load_backend_checkpoint_state(self, model, state, context):
        self.restored = state
        return True


def test_the_checkpoint_hooks_of_the_chosen_fp8_backend_run_and_their_files_load_safely(tmp_path):
    backend = StatefulBackend()
    acc = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(backend))
    model = mlp()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.save_state(tmp_path / "ckpt")
    written = torch.load(tmp_path / "ckpt" / "model_0.pt", weights_only=True)
    assert set(written) == {"encoded"}
    assert torch.equal(
        torch.load(tmp_path / "ckpt" / "fp8_state_0.pt", weights_only=True)["scales"]["w"], torch.tensor([2.0])
    )
    fresh_backend = StatefulBackend()
    fresh = Accelerator(mixed_precision="fp8", plugin_manager=manager_with(fresh_backend))
    fresh_model = mlp(seed=1)
    fresh_model, _ = fresh.prepare(fresh_model, torch.optim.AdamW(fresh_model.parameters()))
    fresh.load_state(tmp_path / "ckpt")
    assert torch.equal(fresh_backend.restored["scales"]["w"], torch.tensor([2.0]))
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


def test_save_and_load_pre_hooks_let_a_script_save_a_model_its_own_way(tmp_path):
    """diffusers' training scripts save their models with save_pretrained from a save_state
    pre-hook, taking those weights out of the list, and load them from a load_state pre-hook."""
    acc = Accelerator(cpu=True)
    own, plain = nn.Linear(4, 4), nn.Linear(4, 2)
    own, plain = acc.prepare(own, plain)

    def save_own(models, weights, output_dir):
        assert len(models) == len(weights) == 2
        torch.save(weights.pop(0), f"{output_dir}/own_model.pt")

    def load_own(models, input_dir):
        models.pop(0).load_state_dict(torch.load(f"{input_dir}/own_model.pt", weights_only=True))

    handles = [acc.register_save_state_pre_hook(save_own), acc.register_load_state_pre_hook(load_own)]
    acc.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "own_model.pt").exists() and (tmp_path / "ckpt" / "model_0.pt").exists()
    assert not (tmp_path / "ckpt" / "model_1.pt").exists()  # the hook saved the first model itself
    saved = {k: v.clone() for k, v in acc.unwrap_model(own).state_dict().items()}, plain.weight.detach().clone()
    with torch.no_grad():
        own.weight.zero_()
        plain.weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(acc.unwrap_model(own).weight, saved[0]["weight"]) and torch.equal(plain.weight, saved[1])
    for handle in handles:
        handle.remove()
    acc.save_state(tmp_path / "again")
    assert (tmp_path / "again" / "model_1.pt").exists()  # removed: lowbit saves both again


class Bookkeeping:
    """A registered object whose state holds what a real script keeps: seen ids, paths, NumPy counters."""

    def __init__(self):
        import numpy as np

        self.state = {
            "seen": {3, 1, 2},
            "frozen": frozenset({"a"}),
            "out": Path("/data/run-7"),
            "tokens": np.int64(12345),
            "loss_ema": np.float32(0.25),
            "hist": np.array([1, 2, 3]),
            "window": range(0, 10, 2),
            "nested": [{"when": Path("x")}, (np.int32(4),)],
        }

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_what_lowbit_saves_of_a_registered_object_it_loads_as_it_was(tmp_path):
    """Such a state was saved, then refused at load as "truncated, corrupted, or not saved by lowbit"."""
    import numpy as np

    acc = Accelerator(cpu=True)
    saved = Bookkeeping()
    acc.register_for_checkpointing(saved)
    acc.save_state(tmp_path / "ckpt")
    loaded = Bookkeeping()
    loaded.state = {}
    other = Accelerator(cpu=True)
    other.register_for_checkpointing(loaded)
    other.load_state(tmp_path / "ckpt")
    got = loaded.state
    assert got["seen"] == {1, 2, 3} and got["frozen"] == frozenset({"a"}) and got["out"] == Path("/data/run-7")
    assert type(got["tokens"]) is np.int64 and got["tokens"] == 12345 and type(got["loss_ema"]) is np.float32
    assert np.array_equal(got["hist"], np.array([1, 2, 3])) and got["window"] == range(0, 10, 2)
    assert got["nested"][0]["when"] == Path("x") and type(got["nested"][1][0]) is np.int32


def test_a_registered_state_the_reader_could_not_read_back_is_refused_at_save_naming_it(tmp_path):
    class Opaque:
        pass

    acc = Accelerator(cpu=True)
    keeper = Bookkeeping()
    keeper.state = {"handle": Opaque()}
    acc.register_for_checkpointing(keeper)
    with pytest.raises(CheckpointError, match=r"registered object 0 \(Bookkeeping\)'s state holds a .*Opaque at"):
        acc.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
