"""A scheduler's SIGTERM to `lowbit launch`: every rank saves through `on_preemption` at the same
step, exits, and nothing is left running (1 and 2 processes, for real)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import TESTS, launch_argv

from lowbit import Accelerator

WORKER = TESTS / "distributed" / "preemption_worker.py"


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a killed process waiting to be reaped (a zombie, re-parented when
    torchrun died with it) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _wait_for(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, loader_workers", [(1, 0), (2, 0), (2, 2)])
def test_sigterm_to_the_launcher_saves_on_every_rank_and_leaves_nothing_running(tmp_path, world, loader_workers):
    """With DataLoader workers too: the signal reaches them as well (the job's process group), and a
    worker it killed ended the epoch with an error before the checkpoint was written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOWBIT_PREEMPTION_GRACE="120")
    flags = ["--cpu", "--num_processes", str(world)]
    launcher = subprocess.Popen(
        launch_argv(*flags, str(WORKER), str(tmp_path), str(loader_workers)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for([tmp_path / f"training_{r}" for r in range(world)], timeout=600)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143, err[-3000:]  # 128 + SIGTERM, under torchrun too (which says 1)
    saved = [int((tmp_path / f"saved_at_{r}").read_text()) for r in range(world)]
    assert len(set(saved)) == 1, saved  # every rank saved after the same step
    assert (tmp_path / "ckpt" / "lowbit_state.json").exists(), err[-3000:]
    pids = [int((tmp_path / f"pid_{r}").read_text()) for r in range(world)]
    time.sleep(1)
    assert not [pid for pid in pids if _alive(pid)], "a rank outlived the launcher"
    assert not list((tmp_path / "ckpt").glob(".lowbit*")), "a temp directory was left behind"
    assert (tmp_path / "main_saw_the_request").exists()  # the main process read it alone, no hang


def test_preemption_is_off_until_the_script_listens():
    import signal as signals

    before = signals.getsignal(signals.SIGTERM)
    acc = Accelerator(cpu=True)
    assert signals.getsignal(signals.SIGTERM) is before  # SIGTERM still ends a script that never checks
    try:
        assert acc.preemption_requested is False
        assert signals.getsignal(signals.SIGTERM) is not before
    finally:
        signals.signal(signals.SIGTERM, before)


@pytest.mark.parametrize("prepared_loader", [True, False])
def test_the_preemption_checkpoint_is_taken_between_iterations(prepared_loader):
    """The callback ran inside optimizer.step(): the weights had moved but the script's scheduler
    and counters had not, so the checkpoint held step N's weights and said step N-1 (a resumed run
    took step N twice). It runs when the loop asks for its next batch, or at the next backward."""
    import signal as signals

    before = signals.getsignal(signals.SIGTERM)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.randn(40, 4), batch_size=4)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    done = {"steps": 0}
    seen = {}
    acc.on_preemption(
        lambda: seen.update(
            steps=done["steps"], scheduler=scheduler.scheduler.last_epoch, weights=model.weight.detach().clone()
        )
    )
    try:
        with pytest.raises(SystemExit) as stop:
            for batch in loader if prepared_loader else iter(lambda: torch.randn(4, 4), None):
                acc.backward(model(batch).pow(2).mean())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                done["steps"] += 1
                if done["steps"] == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives between steps 3 and 4
                last = model.weight.detach().clone()
        assert stop.value.code == 143
    finally:
        signals.signal(signals.SIGTERM, before)
    assert seen["steps"] == seen["scheduler"] == 4  # stopped after step 4's optimizer step, its loop body whole
    assert torch.equal(seen["weights"], last)


def _run_warning_job(out: Path, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", LOWBIT_PREEMPTION_POLL_STEPS="2", **(env_extra or {}))
    out.mkdir()
    command = launch_argv("--cpu", "--num_processes", "2", str(WARNING_WORKER), str(out), *extra)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


WARNING_WORKER = TESTS / "distributed" / "preemption_warning_worker.py"


@pytest.mark.multiprocess
def test_slurms_early_warning_checkpoints_every_rank_at_one_step_and_training_goes_on(tmp_path):
    """SIGUSR1 to the launcher (Slurm's --signal=USR1@90): both ranks save at the same whole
    iteration, the job trains to its end, and its losses are those of a run without the warning."""
    warned = _run_warning_job(tmp_path / "warned", "signal")
    assert warned.returncode == 0, warned.stderr[-3000:]
    plain = _run_warning_job(tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    ranks = [json.loads((tmp_path / "warned" / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["saved_at"] == ranks[1]["saved_at"] and len(ranks[0]["saved_at"]) == 1, ranks
    step = ranks[0]["saved_at"][0]
    assert 3 <= step <= 6 and (tmp_path / "warned" / f"ckpt_{step}" / "lowbit_state.json").exists()
    assert ranks[0]["step"] == 16  # trained on to the end
    unwarned = json.loads((tmp_path / "plain" / "rank0.json").read_text())
    assert unwarned["saved_at"] == [] and ranks[0]["losses"] == unwarned["losses"]
    assert "training goes on" in warned.stderr and "SIGUSR1" in warned.stderr


@pytest.mark.multiprocess
def test_the_early_warning_reaches_ranks_a_no_python_wrapper_runs_as_its_children(tmp_path):
    """A --no_python wrapper that runs Python as a child (not exec): SIGUSR1 reached the wrapper only
    and was lost (no checkpoint, nothing said)."""
    import sys

    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "{WARNING_WORKER}" "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", LOWBIT_PREEMPTION_POLL_STEPS="2")
    out = tmp_path / "warned"
    out.mkdir()
    command = launch_argv("--cpu", "--num_processes", "2", "--no_python", str(wrapper), str(out), "signal")
    warned = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert warned.returncode == 0, warned.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["saved_at"] == ranks[1]["saved_at"] and len(ranks[0]["saved_at"]) == 1, ranks


def test_a_warning_before_the_job_starts_is_held_for_it_not_fatal_to_the_launcher():
    """SIGUSR1 before the launcher's handler was installed killed it (exit -10)."""
    from lowbit.cli import launch

    before = signal.getsignal(signal.SIGUSR1)
    try:
        launch.hold_early_warnings()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert launch.EARLY_WARNINGS == [signal.SIGUSR1]
    finally:
        launch.EARLY_WARNINGS.clear()
        signal.signal(signal.SIGUSR1, before)


def _sigterm_when(worker: str, out: Path, ready: list[Path], grace: str) -> tuple[int, str]:
    """Launch ``worker`` on 2 processes, SIGTERM the launcher once ``ready`` exist; its exit code and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOWBIT_PREEMPTION_GRACE=grace)
    command = launch_argv("--cpu", "--num_processes", "2", str(TESTS / "distributed" / worker), str(out))
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, timeout=600)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return launcher.returncode, err


@pytest.mark.multiprocess
def test_sigterm_while_a_rank_is_joined_saves_on_every_rank(tmp_path):
    """The save waited for the joined rank (it has no next iteration), the launcher killed the job
    at the window's end (rc 137) and no checkpoint was written."""
    code, err = _sigterm_when("preemption_join_worker.py", tmp_path, [tmp_path / "rank1_joined"], grace="120")
    assert code == 143, err[-3000:]
    assert (tmp_path / "saved_0").exists() and (tmp_path / "saved_1").exists(), err[-3000:]
    assert (tmp_path / "ckpt" / "lowbit_state.json").exists()


@pytest.mark.multiprocess
def test_the_grace_kill_reaches_ranks_that_ignore_the_signal(tmp_path):
    """Ranks stuck past the window (here: ignoring SIGTERM) outlived the launcher's kill, which
    reached torchrun's process group only; each rank runs in a session of its own."""
    pid_files = [tmp_path / f"pid_{r}" for r in range(2)]
    _, err = _sigterm_when("stuck_rank_worker.py", tmp_path, pid_files, grace="3")
    assert "did not stop within 3 s" in err, err[-3000:]
    pids = [int(path.read_text()) for path in pid_files]
    time.sleep(1)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:  # the test's own cleanup, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not alive, "a rank outlived the launcher's grace kill"


@pytest.mark.multiprocess
def test_the_early_warning_can_stop_the_job_after_its_checkpoint(tmp_path):
    stopped = _run_warning_job(tmp_path / "stop", "signal", env_extra={"LOWBIT_PREEMPTION_WARNING": "stop"})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert len(list((tmp_path / "stop").glob("ckpt_*"))) == 1 and not (tmp_path / "stop" / "rank0.json").exists()


def test_the_default_window_fits_a_schedulers_30_s(monkeypatch):
    from lowbit.kernel import preemption_window

    monkeypatch.delenv(preemption_window.GRACE_ENV, raising=False)
    assert preemption_window.grace_seconds() < 30  # Slurm's KillWait and Kubernetes' grace period: 30 s by default


def test_the_preemption_note_says_how_long_the_save_took_against_the_window(monkeypatch, recwarn):
    from lowbit.runtime.training.preemption import PreemptionWatch

    monkeypatch.setenv("LOWBIT_PREEMPTION_GRACE", "5")
    watch = PreemptionWatch(num_processes=1)
    watch.callbacks.append(lambda: None)
    watch.signalled, watch.signal_time = True, time.monotonic() - 7.0  # the save ends past the window
    watch.after_step()
    with pytest.raises(SystemExit):
        watch.at_iteration_start()
    said = " ".join(str(w.message) for w in recwarn)
    assert "s after SIGTERM, of a 5 s window" in said and "past the 5 s window" in said


def test_reading_preemption_requested_needs_no_collective_and_follows_the_last_poll(monkeypatch):
    """``if acc.is_main_process and acc.preemption_requested:`` hung a 2-rank job with no output: each
    read was an all-reduce, made by rank 0 alone. A read now takes the ranks' agreement of the last
    poll (at an optimizer step, where every rank polls), and nothing of the others."""
    import signal as signals

    from lowbit.runtime.training.preemption import PreemptionWatch

    before = signals.getsignal(signals.SIGTERM)
    watch = PreemptionWatch(num_processes=2)
    polls = []

    def agree():  # stands for the all-reduce every rank makes at a poll
        polls.append(watch.steps)
        return watch.signalled, False

    monkeypatch.setattr(watch, "_agree", agree)
    try:
        assert watch.requested() is False and polls == []  # read: no collective
        watch.signalled = True  # SIGTERM on this rank
        assert watch.requested() is False  # not agreed yet: every rank still says the same
        for _ in range(watch.poll_every_steps):
            watch.after_step()
        assert polls == [watch.poll_every_steps] and watch.requested() is True
        # A rank that never listened polls at the same steps (the other rank's read must find it there).
        deaf = PreemptionWatch(num_processes=2)
        monkeypatch.setattr(deaf, "_agree", lambda: (polls.append(("deaf", deaf.steps)), (False, False))[1])
        for _ in range(deaf.poll_every_steps):
            deaf.after_step()
        assert polls[-1] == ("deaf", deaf.poll_every_steps)
    finally:
        signals.signal(signals.SIGTERM, before)
