"""Preemption: a scheduler's SIGTERM becomes a flag the training loop checks, so that every rank
saves at the same step and exits, instead of dying mid-step.

``lowbit launch`` forwards SIGTERM (and Ctrl-C's SIGINT) to every process of the job and, after a
grace period (``LOWBIT_PREEMPTION_GRACE`` seconds, 60 by default), kills what is left, so nothing
outlives the launcher. In the script, lowbit takes over SIGTERM once the script shows it listens:
``accelerator.on_preemption(callback)`` or a first read of ``accelerator.preemption_requested``.
Until then SIGTERM ends the process as usual (a loop that never checks would otherwise ignore it).

The ranks must agree: one rank that saves while another still trains would hang both. So the
flag every rank reads is the maximum over the ranks (one small all-reduce per read).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

import torch

from lowbit.kernel.env_numbers import env_number

from lowbit.runtime.collective_device import on_group_device

# Several processes poll the stop signal together this often (in optimizer steps): the all-reduce
# it takes is a host sync. lowbit launch's grace period (60 s) covers 10 steps of up to 6 s; a
# scheduler's shorter grace or longer steps: lower it (LOWBIT_PREEMPTION_POLL_STEPS).
POLL_STEPS_ENV = "LOWBIT_PREEMPTION_POLL_STEPS"
DEFAULT_POLL_STEPS = 10


class PreemptionWatch:
    """One per Accelerator: the SIGTERM flag, the callbacks, and the agreement between ranks."""

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
        self.callbacks: list[Callable[[], None]] = []
        self._installed = False
        self._handled = False
        # The ranks agreed to stop at an optimizer step; the callbacks run at the next iteration's
        # start, once the script's loop body finished (its scheduler step, its counters).
        self.stop_pending = False
        self.steps = 0

    def listen(self) -> None:
        """Take over SIGTERM (from the main thread; elsewhere Python cannot install handlers)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            self.signalled = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._installed = True

    def requested(self) -> bool:
        """Whether any rank was asked to stop (every rank gets the same answer)."""
        self.listen()
        flag = self.signalled
        if self.num_processes > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                agreed = on_group_device(torch.tensor([int(flag)]))
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                flag = bool(agreed.item())
        return flag

    def after_step(self) -> None:
        """At each optimizer step: whether to stop. Several processes agree on the signal every
        ``poll_every_steps`` steps (one small all-reduce and host read then; none in between), one
        process at every step (a flag, no device read). The stop itself waits for the iteration's end
        (:meth:`at_iteration_start`): inside ``optimizer.step()`` the weights have moved but the
        script's own step (its LR scheduler, its counters) has not, so a checkpoint written there
        would hold step N's weights and say step N-1."""
        self.steps += 1
        if self._handled or self.stop_pending or not self.callbacks:
            return
        if self.num_processes > 1 and self.steps % self.poll_every_steps:
            return
        self.stop_pending = self.requested()

    def at_iteration_start(self) -> None:
        """The next batch is asked for (a prepared dataloader), or the next backward starts: the last
        iteration is whole. After an agreed stop: run the callbacks once, then exit (code 143)."""
        if not self.stop_pending or self._handled:
            return
        self._handled = True
        for callback in self.callbacks:
            callback()
        from lowbit.kernel import notices

        notices.note(
            "preemption: the on_preemption callbacks ran; this process exits now (exit code 143).", every_rank=False
        )
        raise SystemExit(143)
