"""The installed Accelerate's launcher flags, every one, against lowbit launch's: each is accepted
(taking a value exactly where Accelerate's does, so that a switch never swallows the script) or
refused by name with what to use instead, never "unrecognized argument"."""

from __future__ import annotations

import argparse
import sys

import pytest

from lowbit.cli.launcher_flags import refusal
from lowbit.cli.main import build_parser, main

accelerate_launch = pytest.importorskip("accelerate.commands.launch")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _lowbit_launch_parser(monkeypatch) -> argparse.ArgumentParser:
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["launch"]


def _takes_a_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def test_every_flag_of_accelerate_launch_is_accepted_or_refused_by_name(monkeypatch):
    theirs = _options(accelerate_launch.launch_command_parser())
    ours = _options(_lowbit_launch_parser(monkeypatch))
    unknown, arity = [], []
    for flag, action in sorted(theirs.items()):
        if flag in ("-h", "--help"):
            continue
        if flag in ours:
            if _takes_a_value(action) != _takes_a_value(ours[flag]):
                arity.append(flag)
        elif not refusal(flag):
            unknown.append(flag)
    assert not unknown, f"accelerate launch flags lowbit neither accepts nor refuses by name: {unknown}"
    assert not arity, f"flags that take a value in one launcher and not in the other: {arity}"
    assert len(theirs) > 200  # the census read Accelerate's real parser (1.15 has 238 spellings)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--use_megatron_lm"], "Megatron-LM"),
        (["--megatron-lm-tp-degree", "2"], "Megatron-LM"),
        (["--tpu"], "TPUs"),
        (["--mpirun_hostfile", "hosts"], "mpirun"),
        (["--aws_access_key_id=x"], "SageMaker"),
    ],
)
def test_a_refused_flag_is_named_with_what_to_use(tmp_path, capsys, flags, named):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert flags[0].split("=")[0] in err and named in err and "unrecognized" not in err
