"""Preemption: a scheduler's SIGTERM becomes a flag the training loop checks, so that every rank
saves at the same step and exits, instead of dying mid-step; its early warning (SIGUSR1, as
Slurm's ``--signal=USR1@90`` sends) becomes a checkpoint at the same step on every rank, after
which training goes on (or stops, ``LOWBIT_PREEMPTION_WARNING=stop``).

``lowbit launch`` forwards SIGTERM (and Ctrl-C's SIGINT) and SIGUSR1 to every process of the job
and, a window after SIGTERM (``LOWBIT_PREEMPTION_GRACE`` seconds, 25 by default: inside the 30 s
that Slurm's ``KillWait`` and Kubernetes' ``terminationGracePeriodSeconds`` give by default), kills
what is left, so nothing outlives the launcher. In the script, lowbit takes over both signals once
the script shows it listens: ``accelerator.on_preemption(callback)`` or a first read of
``accelerator.preemption_requested``. Until then SIGTERM ends the process as usual (a loop that
never checks would otherwise ignore it), and SIGUSR1 is ignored (the launcher starts the job so).

The ranks must agree: one rank that saves while another still trains would hang both. So the
flags every rank reads are the maximum over the ranks (one small all-reduce per read).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable

import torch

from lowbit.kernel.env_numbers import env_number
from lowbit.kernel.preemption_window import GRACE_ENV, WARNING_ENV, grace_seconds, warning_action

from lowbit.runtime.collective_device import on_group_device

# Several processes poll the stop signal together this often (in optimizer steps): the all-reduce
# it takes is a host sync. The window after SIGTERM (25 s) covers 10 steps of up to 2 s and the save;
# longer steps or a larger save: lower it (LOWBIT_PREEMPTION_POLL_STEPS).
POLL_STEPS_ENV = "LOWBIT_PREEMPTION_POLL_STEPS"
DEFAULT_POLL_STEPS = 10
STOP_EXIT_CODE = 143  # 128 + SIGTERM, what a scheduler expects of a job it preempted


class PreemptionWatch:
    """One per run: the SIGTERM flag, the callbacks, and the agreement between ranks."""

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes
        self.poll_every_steps = int(
            env_number(
                POLL_STEPS_ENV,
                DEFAULT_POLL_STEPS,
                whole=True,
                minimum=1,
                meaning="optimizer steps between the ranks' polls",
            )
        )
        self.signalled = False
        self.warned = False  # SIGUSR1 since the last checkpoint
        self.signal_time: float | None = None  # when SIGTERM arrived (monotonic), for the window's note
        self.warning_action = warning_action()
        self.callbacks: list[Callable[[], None]] = []
        self._installed = False
        self._handled = False
        # The ranks agreed to stop at an optimizer step; the callbacks run at the next iteration's
        # start, once the script's loop body finished (its scheduler step, its counters).
        self.stop_pending = False
        self.checkpoint_pending = False
        # What the ranks agreed at the last poll: the answer of preemption_requested on several processes.
        self.agreed_stop = False
        self.steps = 0
        # Inside join_uneven_inputs: the callbacks run at the step that agreed the stop (on a joined
        # rank, in its shadow of that step), not at the next iteration, which a joined rank never has.
        self.at_the_step = False

    def listen(self) -> None:
        """Take over SIGTERM and SIGUSR1 (from the main thread; elsewhere Python cannot install handlers)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            self.signalled = True
            self.signal_time = self.signal_time or time.monotonic()
            if callable(previous):
                previous(signum, frame)

        def on_sigusr1(signum, frame):
            self.warned = True

        signal.signal(signal.SIGTERM, on_sigterm)
        signal.signal(signal.SIGUSR1, on_sigusr1)
        self._installed = True

    def requested(self) -> bool:
        """Whether the job was asked to stop, with no collective (a read on one rank only, ``if
        is_main_process and preemption_requested``, must not hang the others): on one process, this
        process's signal; on several, what the ranks agreed at the last poll (every
        ``poll_every_steps`` optimizer steps), so every rank reading at the same point of the loop
        gets the same answer."""
        self.listen()
        if self.num_processes == 1:
            return self._asked_to_stop()
        return self.agreed_stop

    def _asked_to_stop(self) -> bool:
        return self.signalled or (self.warned and self.warning_action == "stop")

    def _agree(self) -> tuple[bool, bool]:
        """(stop, checkpoint): whether any rank was asked either, in one all-reduce."""
        stop = self._asked_to_stop()
        checkpoint = self.warned
        if self.num_processes > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                agreed = on_group_device(torch.tensor([int(stop), int(checkpoint)]))
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                stop, checkpoint = (bool(flag) for flag in agreed.tolist())
        return stop, checkpoint

    def after_step(self) -> None:
        """At each optimizer step: whether to stop or checkpoint. Several processes agree on the
        signals every ``poll_every_steps`` steps, listening or not (one small all-reduce and host read
        then; none in between), one process at every step it listens (a flag, no device read). The
        save itself waits for the iteration's end (:meth:`at_iteration_start`): inside
        ``optimizer.step()`` the weights have moved but the script's own step (its LR scheduler, its
        counters) has not, so a checkpoint written there would hold step N's weights and say step N-1."""
        self.steps += 1
        if self._handled or self.stop_pending or self.checkpoint_pending or self.agreed_stop:
            return
        if self.num_processes > 1:
            # Every rank polls at the same steps, whether it listens or not: a script that reads
            # preemption_requested (or registers on_preemption) on one rank only must not leave the
            # others out of the all-reduce (that hung the job).
            if self.steps % self.poll_every_steps:
                return
        elif not (self.callbacks or self._installed):  # one process: nothing to agree, nothing asked
            return
        stop, checkpoint = self._agree()
        self.agreed_stop = stop
        if self.callbacks:
            self.stop_pending = stop
            self.checkpoint_pending = checkpoint and not stop
            if self.at_the_step:  # join_uneven_inputs: every rank saves here, the joined ones in their shadow
                self.at_iteration_start()

    def at_iteration_start(self) -> None:
        """The next batch is asked for (a prepared dataloader), or the next backward starts: the last
        iteration is whole. After an agreed stop: run the callbacks once, then exit (code 143). After
        an agreed early warning: run them, and train on."""
        if self._handled or not (self.stop_pending or self.checkpoint_pending):
            return
        from lowbit.kernel import notices

        started = time.monotonic()
        for callback in self.callbacks:
            callback()
        took = time.monotonic() - started
        if self.checkpoint_pending:
            self.checkpoint_pending = self.warned = False
            notices.note(
                f"preemption warning (SIGUSR1): the on_preemption callbacks ran at step {self.steps} in {took:.1f} s; "
                f"training goes on ({WARNING_ENV}=stop stops after the checkpoint)."
            )
            return
        self._handled = True
        notices.note(f"preemption: {self._against_the_window(took)}; this process exits now (exit code 143).")
        raise SystemExit(STOP_EXIT_CODE)

    def _against_the_window(self, took: float) -> str:
        """How long the save took, and when it ended against the window after SIGTERM."""
        said = f"the on_preemption callbacks ran at step {self.steps} in {took:.1f} s"
        if self.signal_time is None:  # stopped on the early warning: no window runs
            return said
        since, window = time.monotonic() - self.signal_time, grace_seconds()
        if since > window:
            from lowbit.kernel import notices

            notices.warn(
                f"preemption: the save ended {since:.1f} s after SIGTERM, past the {window:.0f} s window "
                f"({GRACE_ENV}): the job may have been killed while saving. Poll more often "
                f"({POLL_STEPS_ENV}, now {self.poll_every_steps}), save less, or ask the scheduler for a longer "
                "window and set it here."
            )
        return f"{said}, {since:.1f} s after SIGTERM, of a {window:.0f} s window ({GRACE_ENV})"
