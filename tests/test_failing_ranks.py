"""A rank that fails ends the whole job quickly, with its traceback, instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import launch_argv

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).parent / "distributed" / "failing_rank_worker.py"


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_ends_the_job_within_a_minute(tmp_path, fail_rank):
    stamp = tmp_path / "failed_at"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1")
    cmd = launch_argv("--cpu", "--num_processes", "2", str(WORKER), "raise", str(fail_rank), str(stamp))
    # The wide limit only stops a hung job from hanging the suite; the assertion is on the time
    # from the failure to the exit, which startup time on a busy machine does not affect.
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    ended = time.time()
    assert stamp.exists(), proc.stderr[-3000:]
    assert proc.returncode != 0
    print(f"rank {fail_rank} failed; the job ended {ended - float(stamp.read_text()):.1f} s later")  # pytest -s
    assert ended - float(stamp.read_text()) < 60, f"the job took {ended - float(stamp.read_text()):.0f} s to end"
    assert "ValueError: rank failed on purpose" in proc.stderr


def test_exit_waits_for_busy_native_threads_but_not_for_idle_ones():
    """The normal-exit path gives other threads of the process a GIL-free moment before shutdown:
    it returns at once when they are idle, and waits (up to its limit) while one is running."""
    import subprocess
    import threading
    import time

    from lowbit.runtime.process_group import wait_for_native_threads_to_settle

    # Idle: a fresh process has no other thread, so it settles at once however busy the machine.
    idle = Path(__file__).parent / "scripts" / "settle_threads.py"
    assert subprocess.run([sys.executable, str(idle)], timeout=1500).returncode == 0
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        started = time.monotonic()
        assert not wait_for_native_threads_to_settle(timeout=0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        stop.set()
        worker.join()


def test_save_state_on_the_main_process_only_is_an_error_naming_the_missing_rank(tmp_path):
    """The mistake ``if accelerator.is_main_process: accelerator.save_state(...)``: the other rank
    never arrives. After LOWBIT_ARRIVAL_TIMEOUT (10 s here; 60 s by default, independent of the
    process group's timeout, 30 minutes on gloo) the job ends with an error naming the rank and the
    fix, instead of hanging."""
    worker = os.path.join(os.path.dirname(__file__), "distributed", "subset_save_worker.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1", LOWBIT_ARRIVAL_TIMEOUT="10")
    cmd = launch_argv("--cpu", "--num_processes", "2", worker, str(tmp_path / "ckpt"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode != 0
    assert "save_state must be called on every process at the same point" in proc.stderr, proc.stderr[-3000:]
    assert "rank(s) 1 did not come within 10 s" in proc.stderr, proc.stderr[-3000:]


def test_a_stuck_rank_is_noticed_after_the_process_group_timeout(tmp_path):
    """InitProcessGroupKwargs(timeout=15 s): the rank waiting in the all-reduce gives up, names the
    rank it waited for, and the whole job ends instead of hanging (torch's default would wait 30
    minutes). The bound below only tells the two apart; it leaves a busy machine room."""
    stamp = tmp_path / "stuck_at"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(OMP_NUM_THREADS="1")
    cmd = launch_argv("--cpu", "--num_processes", "2", str(WORKER), "stuck", "1", str(stamp))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    ended = time.time()
    assert stamp.exists() and proc.returncode != 0, proc.stderr[-3000:]
    waited = ended - float(stamp.read_text())
    print(f"a rank got stuck; the job ended {waited:.1f} s later (timeout 15 s)")  # pytest -s
    assert waited < 900, f"the job took {waited:.0f} s to end: the 15 s timeout was not applied"
    assert "Timed out" in proc.stderr or "timed out" in proc.stderr
    assert "rank 0 timed out in a collective; rank(s) 1 never arrived" in proc.stderr, proc.stderr[-3000:]
