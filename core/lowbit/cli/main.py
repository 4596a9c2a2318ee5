"""Entry point of the ``lowbit`` command: dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from lowbit.kernel.errors import LowbitError

SUBCOMMANDS = {
    "plugins": ("lowbit.cli.plugins_command", "list installed backends, their priority and availability"),
    "env": ("lowbit.cli.env_command", "print versions, hardware, plugins and config for a bug report"),
    "config": ("lowbit.cli.config_command", "write the YAML config (interactive, from flags, or --default)"),
    "launch": ("lowbit.cli.launch", "run a training script on one process or many (torchrun)"),
    "test": ("lowbit.cli.self_test_command", "check this setup end to end with a tiny training run"),
    "estimate-memory": (
        "lowbit.cli.estimate_memory_command",
        "estimate per-process memory of training a model, per precision and strategy",
    ),
    "fp8-payoff": (
        "lowbit.cli.fp8_payoff_command",
        "predict whether FP8 speeds up a model's training step on a GPU, per layer",
    ),
    "new-backend": (
        "lowbit.cli.new_backend_command",
        "write a ready-to-install backend or strategy distribution to start from",
    ),
}


class _VersionAction(argparse.Action):
    """``lowbit --version``: the version is read from the distribution's metadata (about 20 ms), so
    only when asked, not on every command."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help="show lowbit's version"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from lowbit.kernel.version import __version__

        parser.exit(message=f"lowbit {__version__}\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="lowbit", description="FP8 / BF16 / FP16 training for plain PyTorch scripts.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name in sys.argv[1:2]:  # only the chosen subcommand builds its (maybe plugin-extended) parser
            importlib.import_module(module_name).add_parser(sub, name, help_text)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # before anything else: a scheduler's early SIGUSR1 must not kill the launcher
        from lowbit.cli.launch import hold_early_warnings

        hold_early_warnings()
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
    finally:
        sys.argv = saved
    if unknown:
        return _unknown_flags(parser, args.command, unknown)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except LowbitError as exc:
        print(f"lowbit {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _unknown_flags(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> int:
    """A misspelt flag gets the nearest flag of its own subcommand and that subcommand's usage
    (argparse would print the top-level usage and no suggestion)."""
    from lowbit.kernel.errors import did_you_mean

    sub = _subparser(parser, command)
    known = [flag for action in (sub or parser)._actions for flag in action.option_strings]
    flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
    if command == "launch":  # accelerate launch's flags that lowbit refuses, by name, with what to use
        from lowbit.cli.launcher_flags import refusal

        why = next((refusal(u) for u in unknown if u.startswith("-") and refusal(u)), None)
        if why:
            refused = next(u for u in unknown if u.startswith("-") and refusal(u)).split("=")[0]
            print(f"lowbit launch: error: {refused}: {why}.", file=sys.stderr)
            return 2
    if sub is not None:
        sub.print_usage(sys.stderr)
    where = f"lowbit {command}" if command else "lowbit"
    print(
        f"{where}: error: unrecognized argument {flag!r}.{did_you_mean(flag, known)}"
        + (f" `lowbit {command} --help` lists them." if command else ""),
        file=sys.stderr,
    )
    return 2


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


if __name__ == "__main__":
    raise SystemExit(main())
