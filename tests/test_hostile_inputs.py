"""Inputs that real scripts and clusters produce, each with the clear error (or the safe handling) it deserves."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import FakeBackend, launch_argv
from torch import nn

from lowbit import Accelerator

from lowbit.kernel.errors import CheckpointError, ConfigError, UnsupportedCombinationError

from lowbit.run.plugin_manager import make_plugin_manager
from lowbit.run.settings import read_config_file


def test_a_key_given_twice_in_a_config_file_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: fp8\nnum_processes: 2\nmixed_precision: bf16\n")
    with pytest.raises(ConfigError, match=r"line 3: key 'mixed_precision' is given twice \(lines 1 and 3\)"):
        read_config_file(path)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"amax_history_len": -5}, "'amax_history_len' .*must be at least 1, got -5"),
        ({"amax_history_len": 0}, "'amax_history_len' .*must be at least 1, got 0"),
        ({"interval": 0}, "'interval' .*must be at least 1, got 0"),
        ({"margin": -3}, "'margin' .*must be at least 0, got -3"),
    ],
)
def test_out_of_range_fp8_options_are_refused_in_code_and_in_files(tmp_path, option, message):
    te_recipe = pytest.importorskip("lowbit_te.recipe")
    with pytest.raises(ConfigError, match=message):
        te_recipe.TERecipeKwargs(**option)
    from lowbit.run.settings import validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config({"mixed_precision": "fp8", "fp8_config": option})


def test_checkpoint_metadata_naming_a_path_outside_the_checkpoint_is_refused(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(4, 4))
    acc.save_state(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "lowbit_state.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["../x"] = meta["files"].pop(next(iter(meta["files"])))
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"file name '../x' is not a plain path inside the checkpoint"):
        acc.load_state(tmp_path / "ckpt")
    assert model is not None


def test_a_checkpoint_from_another_number_of_processes_loads_with_a_note_naming_both(tmp_path, recwarn):
    """lowbit's own files hold whole tensors, so they load on any number of processes (each rank
    takes saved rank r mod N's random state); the note names both counts."""
    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(4, 4))
    acc.save_state(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "lowbit_state.json"
    meta = json.loads(meta_path.read_text())
    meta["world_size"] = 2  # as if saved by 2 processes (rank 1's RNG file would be beside rank 0's)
    meta_path.write_text(json.dumps(meta))
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(model.weight, saved)
    assert "saved by 2 process(es), this run has 1" in " ".join(str(w.message) for w in recwarn)


def test_a_model_the_user_wrapped_in_ddp_is_unwrapped_not_wrapped_twice(monkeypatch, recwarn):
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Linear(4, 4)
    wrapped = DistributedDataParallel.__new__(DistributedDataParallel)  # the wrapper object, without a process group
    nn.Module.__init__(wrapped)
    wrapped.module = model
    prepared = Accelerator(cpu=True).prepare(wrapped)
    assert prepared is model or getattr(prepared, "module", None) is model
    assert any("already wrapped in DistributedDataParallel" in str(w.message) for w in recwarn)


def test_a_model_already_sharded_with_fsdp_is_refused():
    class FSDPModule(nn.Module):  # the class fully_shard mixes into a module
        pass

    class Sharded(FSDPModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 4)

    with pytest.raises(UnsupportedCombinationError, match=r"already sharded \(FSDPModule\).*Pass the plain model"):
        Accelerator(cpu=True).prepare(Sharded())


def test_a_plugin_that_calls_sys_exit_at_import_is_marked_broken():
    class EntryPoint:
        name, dist = "exits", None

    def loader(ep):
        sys.exit(3)

    import lowbit.kernel.manager as plugins

    original = plugins._selected_entry_points
    plugins._selected_entry_points = lambda: [EntryPoint()]
    try:
        manager = make_plugin_manager(entry_point_loader=loader, extra_plugins=[FakeBackend("good", 100)])
    finally:
        plugins._selected_entry_points = original
    assert any(b.name == "exits" and "called sys.exit(3) while being imported" in b.error for b in manager.broken)
    assert Accelerator(mixed_precision="fp8", plugin_manager=manager).fp8_backend == "good"


@pytest.mark.parametrize("mode", ["skip", "continue", "raise"])
def test_a_nan_loss_is_reported_on_its_step_and_handled_as_asked(mode, recwarn):
    import torch

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, on_nonfinite_loss=mode)
    model, opt = acc.prepare(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    acc.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
    x[0, 0] = float("nan")
    acc.backward(model(x).pow(2).mean())
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=r"the loss or a gradient of optimizer step 2 is NaN or inf"):
            opt.step()
        return
    before = model.weight.detach().clone()
    opt.step()
    messages = [str(w.message) for w in recwarn]
    if mode == "skip":
        assert any("of optimizer step 2 is NaN or inf" in m for m in messages), messages
        assert acc.optimizer_step_was_skipped and torch.equal(model.weight, before)
    else:  # Accelerate's behaviour: nothing checked (no host read), the step runs
        assert not any("NaN or inf" in m for m in messages), messages
        assert not acc.optimizer_step_was_skipped and not torch.isfinite(model.weight).all()


class _NaNGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradient overflowed (what a bad kernel does)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


@pytest.mark.parametrize("clipped", [False, True])
def test_a_nan_gradient_under_a_finite_loss_is_reported_and_its_step_skipped(clipped, recwarn):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    for step, poison in ((1, False), (2, True), (3, False)):
        out = model(x)
        loss = (_NaNGradient.apply(out) if poison else out).pow(2).mean()
        assert torch.isfinite(loss)
        acc.backward(loss)
        if clipped:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        before = model.weight.detach().clone()
        opt.step()
        opt.zero_grad()
        assert acc.optimizer_step_was_skipped == poison, step
        assert torch.equal(model.weight, before) == poison
    messages = [str(w.message) for w in recwarn]
    assert sum("optimizer step 2 is NaN or inf" in m for m in messages) == 1, messages
    assert torch.isfinite(model.weight).all()


def test_a_nan_gradient_outside_the_clipped_parameters_is_caught_too(recwarn):
    """clip_grad_norm_(body) and a NaN in the head's gradient: the norm is finite, yet the head's
    step would make its weights NaN. The verdict covers every parameter the optimizer updates."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    body, head = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.Sequential(body, head)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    head.weight.register_hook(lambda grad: grad * float("nan"))
    acc.backward(model(torch.randn(8, 4)).pow(2).mean())
    norm = acc.clip_grad_norm_(body.parameters(), 1.0)
    assert torch.isfinite(norm)
    opt.step()
    assert acc.optimizer_step_was_skipped and torch.isfinite(head.weight).all()
    assert any("optimizer step 1 is NaN or inf" in str(w.message) for w in recwarn)


def test_a_checkpoint_on_read_only_storage_loads_beside_a_leftover_temp_directory(tmp_path, monkeypatch, recwarn):
    import shutil

    from lowbit.runtime.checkpoint import files

    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(4, 4))
    acc.save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt" / files.STAGING_DIR).mkdir()  # what a killed save leaves

    def read_only(path, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(shutil, "rmtree", read_only)
    acc.load_state(tmp_path / "ckpt")
    assert any("could not remove" in str(w.message) and "Read-only file system" in str(w.message) for w in recwarn)
    assert model is not None


def test_two_plugins_claiming_the_only_backend_name_the_clash_not_an_install():
    from helpers import manager_with

    first, second = FakeBackend("ao", 100), FakeBackend("ao", 100)
    manager = manager_with(first, second)
    from lowbit.kernel.errors import BackendUnavailableError

    with pytest.raises(
        BackendUnavailableError,
        match=r"No usable low-precision backend: low-precision backend name 'ao' is claimed by both",
    ) as info:
        Accelerator(mixed_precision="fp8", plugin_manager=manager)
    assert "pip install" not in str(info.value)


def test_two_writers_into_one_checkpoint_directory_get_a_clear_error(tmp_path):
    import fcntl
    import os

    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(4, 4))
    acc.save_state(tmp_path / "ckpt")
    fd = os.open(tmp_path / "ckpt", os.O_RDONLY)  # another writer, mid-save
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CheckpointError, match="Another save_state is writing into .* right now"):
            acc.save_state(tmp_path / "ckpt")
    finally:
        os.close(fd)
    acc.save_state(tmp_path / "ckpt")  # once it is done, saving works again
    acc.load_state(tmp_path / "ckpt")


def test_accelerates_fsdp_plugin_keywords_are_accepted_and_the_ones_without_effect_named(recwarn):
    from lowbit.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        cpu_ram_efficient_loading=True,
        sync_module_states=True,
        use_orig_params=True,
        sharding_strategy="SHARD_GRAD_OP",
        limit_all_gathers=True,
    )
    # the loading keywords fill every rank from rank 0 (tests/core/builtin/test_rank0_weights.py)
    assert plugin.to_fsdp_config() == {
        "reshard_after_forward": False,
        "cpu_ram_efficient_loading": True,
        "sync_module_states": True,
    }
    said = " ".join(str(w.message) for w in recwarn)
    assert "fsdp_use_orig_params" in said and "limit_all_gathers" in said
    assert "cpu_ram_efficient_loading" not in said


def test_a_prepared_dataloader_can_be_prepared_again_as_accelerate_allows():
    import torch

    acc = Accelerator(cpu=True)
    loader = acc.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(21.0)), batch_size=8))
    assert acc.prepare(loader) is loader
    assert Accelerator(cpu=True).prepare(loader) is loader  # prepared by another Accelerator: taken as it is
    assert sum(len(acc.gather_for_metrics(x)) for (x,) in loader) == 21


def test_lowbit_num_processes_is_honoured_by_the_launcher(tmp_path, monkeypatch):
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.setenv("LOWBIT_NUM_PROCESSES", "2")
    monkeypatch.setenv("LOWBIT_CONFIG_FILE", str(tmp_path / "none.yaml"))
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    command, _, config = build_command(build_parser().parse_args(["launch", "--cpu", str(script)]))
    assert config.num_processes == 2 and command[command.index("--nproc_per_node") + 1] == "2"


def test_an_inf_gradient_with_a_finite_loss_is_caught_where_the_norm_is_clipped(recwarn):
    import torch

    acc = Accelerator(cpu=True)
    model = nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(8, 4)).pow(2).mean())
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert acc.optimizer_step_was_skipped and torch.equal(model.weight, before)
    assert any("a gradient of optimizer step 1 is NaN or inf" in str(w.message) for w in recwarn)


@pytest.mark.multiprocess
def test_gather_for_metrics_drops_padding_of_a_loader_another_accelerator_prepared(tmp_path):
    """Accelerate's benchmarks/fp8 scripts prepare with one Accelerator and evaluate with another:
    the dataloader's position is the process's, as in Accelerate, so the padding of the last
    round (21 samples over 2 ranks x 4) is dropped. With drop_last (their eval loaders) nothing is
    padded, so nothing is dropped: 16 samples in 2 full rounds."""
    import os
    from pathlib import Path

    from helpers import run_launch

    worker = Path(__file__).parent / "distributed" / "two_accelerators_worker.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1")
    out = tmp_path / "seen.json"
    proc = run_launch(
        launch_argv("--cpu", "--num_processes", "2", str(worker), str(out)),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert sorted(seen["False"]) == [float(i) for i in range(21)]
    assert sorted(seen["True"]) == [float(i) for i in range(16)]


@pytest.mark.parametrize("interrupt_at", range(0, 12))
@pytest.mark.parametrize("previous", [False, True])
def test_ctrl_c_at_any_point_of_the_commit_leaves_the_directory_saveable(tmp_path, monkeypatch, interrupt_at, previous):
    """KeyboardInterrupt on each file move of save_state's commit: the directory keeps its previous
    checkpoint (or nothing), and the next save_state and load_state work."""
    import os

    import torch
    from helpers import Counter

    from lowbit.runtime.checkpoint import files

    acc = Accelerator(cpu=True)
    counter = Counter()
    model, opt = acc.prepare(nn.Linear(4, 4), torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1))
    if previous:
        acc.save_state(tmp_path / "ckpt")
    acc.register_for_checkpointing(counter)  # a file the previous checkpoint does not have
    calls, real_replace = {"n": 0}, os.replace

    def interrupted_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == interrupt_at + 1:  # one Ctrl-C, at this move
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", interrupted_replace)
    try:
        acc.save_state(tmp_path / "ckpt")
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(files.os, "replace", real_replace)
    counter.n = 7
    acc.save_state(tmp_path / "ckpt")  # never refuses its own files
    counter.n = 0
    acc.load_state(tmp_path / "ckpt")
    assert counter.n == 7


def test_a_finished_dataloader_leaves_no_end_of_dataloader_behind():
    """The dataloader position is the process's: once a loop over a loader is over, nothing is at
    its end any more, so gradient accumulation elsewhere is not forced to sync on every micro-batch."""
    import torch

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = acc.prepare(nn.Linear(4, 4))
    loader = acc.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4))
    for _ in loader:
        pass
    assert not acc.gradient_state.end_of_dataloader
    with acc.accumulate(model):
        assert not acc.sync_gradients  # the first of 2 micro-batches


def test_a_collective_timeout_names_the_ranks_that_left_no_mark():
    """What a timed-out rank prints (the 2-process case runs in test_failing_ranks.py): ranks 0 and
    2 timed out in the same collective, rank 1 never arrived; every rank timing out means the ranks
    were in different collectives."""
    import torch.distributed as dist

    from lowbit.runtime.collective_timeouts import describe, is_collective_timeout, ranks_that_did_not_arrive

    store = dist.HashStore()
    store.set("lowbit/timed_out/2", "1")
    assert ranks_that_did_not_arrive(store, 0, 3, window_s=0.5) == [1]
    assert "rank(s) 1 never arrived" in describe(0, 3, [1]) and "rank(s) 0, 2 waited" in describe(0, 3, [1])
    store.set("lowbit/timed_out/1", "1")
    assert ranks_that_did_not_arrive(store, 0, 3, window_s=0.5) == []
    assert "different collectives" in describe(0, 3, [])
    assert is_collective_timeout(
        RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv")
    )
    assert is_collective_timeout(RuntimeError("Application timeout caused pair closure"))
    assert not is_collective_timeout(RuntimeError("Connection reset by peer")) and not is_collective_timeout(
        ValueError("timeout")
    )
    assert not is_collective_timeout(RuntimeError("the data server timed out"))  # the user's own, not a collective
