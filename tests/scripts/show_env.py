"""Prints, as one line of JSON written at once, what a launched script sees: every LOWBIT_* variable,
RANK, WORLD_SIZE and the variables named as arguments. ``--exit N`` ends with exit code N.

    lowbit launch tests/scripts/show_env.py MY_KNOB --exit 3
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    code = int(argv[argv.index("--exit") + 1]) if "--exit" in argv else 0
    names = {a for i, a in enumerate(argv) if a != "--exit" and (i == 0 or argv[i - 1] != "--exit")}
    shown = {k: v for k, v in os.environ.items() if k.startswith("LOWBIT_") or k in {"RANK", "WORLD_SIZE", *names}}
    sys.stdout.write(json.dumps(dict(sorted(shown.items()))) + "\n")  # one write: ranks' lines never interleave
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
