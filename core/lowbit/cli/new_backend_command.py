"""``lowbit new-backend NAME [--kind strategy] [--precision fp4]``: a ready-to-install plugin distribution to start
from."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("name", help="the backend's name, as users will select it (lower case: myfp8)")
    parser.add_argument("--dir", default=".", help="where to create lowbit-NAME/ (default: here)")
    parser.add_argument(
        "--kind",
        default="backend",
        choices=("backend", "strategy"),
        help="a low-precision backend (default) or a distributed strategy",
    )
    parser.add_argument(
        "--precision", default="fp8", help="the mixed_precision name the backend serves (default fp8; e.g. fp4)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lowbit.cli.scaffold import write_backend

    root = write_backend(args.name, Path(args.dir), kind=args.kind, precision=args.precision)
    print(
        f"wrote {root}/: pyproject.toml (entry point {args.name!r}), lowbit_{args.name}/__init__.py, "
        "tests/test_conformance.py, README.md"
    )
    module = root / f"lowbit_{args.name}" / "__init__.py"
    if args.kind == "strategy":
        print(
            f"next: `pip install -e {root}[test]` and `pytest {root}` (it trains as written: torch's "
            "DistributedDataParallel), then make "
            f"wrap_for_distribution in {module} your strategy"
        )
    else:
        print(f"next: fill in convert_model in {module}, then `pip install -e {root}[test]` and `pytest {root}`")
    return 0
