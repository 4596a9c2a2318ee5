"""Is a rendezvous store listening at HOST:PORT? ``python -m lowbit.cli.rendezvous_probe HOST PORT SECONDS``
exits 0 when a c10d ``TCPStore`` answers there within SECONDS. ``lowbit launch`` runs it in a process
of its own, under a hard time limit: a client of a port that some other program holds can wait
on it without end."""

from __future__ import annotations

import sys
from datetime import timedelta


def main(argv: list[str]) -> int:
    host, port, seconds = argv[0], int(argv[1]), float(argv[2])
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=seconds))
    store.check(["lowbit"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
