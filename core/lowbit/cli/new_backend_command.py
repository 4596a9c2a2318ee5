"""``lowbit new-backend NAME``: write a ready-to-install FP8 backend distribution to start from."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("name", help="the backend's name, as users will select it (lower case: myfp8)")
    parser.add_argument("--dir", default=".", help="where to create lowbit-NAME/ (default: here)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lowbit.scaffold import write_backend

    root = write_backend(args.name, Path(args.dir))
    print(f"wrote {root}/: pyproject.toml (entry point {args.name!r}), lowbit_{args.name}/__init__.py, "
          "tests/test_conformance.py, README.md")
    print(f"next: fill in convert_model in {root / f'lowbit_{args.name}' / '__init__.py'}, then "
          f"`pip install -e {root}[test]` and `pytest {root}`")
    return 0
