"""Which ranks a timed-out collective waited for.

torch reports a collective that waited past the process group's timeout as an error in each
waiting rank, naming no rank (gloo names a peer's address, NCCL a sequence number). A rank that
dies of such an error leaves a mark in the job's key-value store (the one the process group was
built on, which still works when the collective did not) and waits a few seconds for the marks of
the others: the ranks that timed out too were waiting with it; the ranks that left no mark never
arrived (stuck elsewhere in the script, or gone). It says so in one line, after the traceback.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

# How long a timed-out rank waits for the others' marks: ranks waiting in the same collective time
# out within moments of each other; this leaves a busy machine room without delaying the exit much.
MARK_WINDOW_S = 10.0
_KEY = "lowbit/timed_out/{rank}"
# What torch 2.13's process groups say (seen over gloo: "[gloo/transport/tcp/unbound_buffer.cc:78]
# Timed out waiting 5000ms for recv operation to complete", then "Application timeout caused pair
# closure" for the next collective; NCCL's watchdog: "collective operation timeout"). A user's own
# RuntimeError that merely mentions a timeout is not one of them.
_TIMEOUT_TEXT = re.compile(
    r"timed out waiting|application timeout|collective operation timeout|watchdog caught", re.IGNORECASE
)


def is_collective_timeout(exc: BaseException) -> bool:
    """A process-group error (plain RuntimeErrors over gloo, DistBackendError over NCCL) that says
    it waited too long."""
    return isinstance(exc, RuntimeError) and bool(_TIMEOUT_TEXT.search(str(exc)))


def _default_store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    # The store the default group was built on; private, so its absence only costs the report.
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    return get_store() if callable(get_store) else None


def ranks_that_did_not_arrive(store: Any, rank: int, world_size: int, window_s: float = MARK_WINDOW_S) -> list[int]:
    """Mark this rank as timed out, then return the ranks that left no such mark within ``window_s``."""
    store.set(_KEY.format(rank=rank), "1")
    others = [r for r in range(world_size) if r != rank]
    keys = [_KEY.format(rank=r) for r in others]
    deadline = time.monotonic() + window_s
    # One request per poll (check() answers for all keys at once), so that many ranks timing out
    # together do not flood the store; rank by rank only once, at the end.
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return [r for r, key in zip(others, keys) if not store.check([key])]
        time.sleep(0.5)
    return []


def describe(rank: int, world_size: int, missing: list[int]) -> str:
    if not missing:
        return (
            f"lowbit: error: rank {rank} timed out in a collective, and so did every other rank: they were "
            "waiting in different collectives (a call made on some ranks only, or in a different order)."
        )
    names = ", ".join(str(r) for r in missing)
    waited = sorted(set(range(world_size)) - set(missing))
    return (
        f"lowbit: error: rank {rank} timed out in a collective; rank(s) {names} never arrived (stuck elsewhere "
        f"in the script, or gone), while rank(s) {', '.join(map(str, waited))} waited. Raise the limit with "
        "InitProcessGroupKwargs(timeout=...) if those ranks were only slow."
    )


def report_if_timeout(exc: BaseException) -> None:
    """After an uncaught error: if it is a collective timeout, name the ranks it waited for."""
    if not is_collective_timeout(exc):
        return
    try:
        import torch.distributed as dist

        store = _default_store()
        if store is None:
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        print(
            describe(rank, world_size, ranks_that_did_not_arrive(store, rank, world_size)), file=sys.stderr, flush=True
        )
    except Exception:  # noqa: BLE001 - the report is a courtesy on the way out; the error itself was printed
        return
