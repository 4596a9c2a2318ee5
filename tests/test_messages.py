"""What lowbit says, and how: one voice for notices, errors that name their source and the way out."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit import Accelerator

from lowbit.kernel.errors import ConfigError

SCRIPTS = Path(__file__).parent / "scripts"
SAY_NOTICES = str(SCRIPTS / "say_notices.py")


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900, env=env)


def test_notices_are_one_line_once_with_no_lowbit_source_line():
    pytest.importorskip("lowbit_ao")
    lines = _run(SAY_NOTICES).stderr.splitlines()
    emulation = [line for line in lines if "lowbit-ao emulates them" in line]
    assert len(emulation) == 1 and emulation[0].startswith("lowbit: note: CPU has no FP8 GEMMs"), lines
    assert sum(line.startswith("lowbit: note: fp8 (ao, tensorwise, emulated): 1 of 3") for line in lines) == 1, lines
    # No location line in lowbit's sources, and no source line echoed from them. (Not "lowbit" anywhere in a
    # line: a checkout in a folder named lowbit puts it in the user's own warning's location.)
    import lowbit

    import lowbit_ao

    sources = [str(Path(package.__file__).parent) for package in (lowbit, lowbit_ao)]
    assert not [line for line in lines if any(source in line for source in sources)], lines
    assert not [line for line in lines if "warnings.warn" in line and "the user's own warning" not in line], lines
    assert any("UserWarning: the user's own warning" in line for line in lines)  # other warnings keep Python's form


def test_notices_are_real_warning_categories_that_users_filter():
    pytest.importorskip("lowbit_ao")
    stderr = _run(SAY_NOTICES, "--ignore-lowbit-notes").stderr
    assert "lowbit: note:" not in stderr and "the user's own warning" in stderr


def test_notices_are_said_on_the_main_rank_only(tmp_path):
    """Under `lowbit launch` with 2 processes: once in all, and the launcher's own notes not again by the ranks."""
    pytest.importorskip("lowbit_ao")
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\nmixed_precision: fp8\nnum_processes: 2\nrdzv_backend: static\n"
    )
    proc = _run(
        "-m",
        "lowbit.cli.main",
        "launch",
        "--cpu",
        "--config_file",
        str(config),
        SAY_NOTICES,
        env_extra={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("lowbit-ao emulates them") == 1, proc.stderr
    assert proc.stderr.count("settings with no effect in lowbit") == 1, proc.stderr


@pytest.mark.parametrize("way", ["handler", "env", "config file"])
def test_an_fp8_option_without_fp8_is_the_same_error_every_way(tmp_path, monkeypatch, way):
    pytest.importorskip("lowbit_ao")
    from lowbit.utils import AORecipeKwargs

    kwargs: dict = {"mixed_precision": "bf16"}
    if way == "handler":
        kwargs["kwargs_handlers"] = [AORecipeKwargs()]
        source = "AORecipeKwargs"
    elif way == "env":
        monkeypatch.setenv("LOWBIT_FP8_BACKEND", "ao")
        source = "env LOWBIT_FP8_BACKEND"
    else:
        path = tmp_path / "c.yaml"
        path.write_text("mixed_precision: bf16\nfp8_config:\n  recipe: tensorwise\n")
        kwargs = {"config_file": str(path)}
        source = "config file fp8_config.recipe"
    with pytest.raises(
        ConfigError,
        match=rf"FP8 options were given \({source}\) but mixed_precision is 'bf16'.*"
        r"Set mixed_precision='fp8'",
    ):
        Accelerator(**kwargs)


def test_a_misspelt_launcher_flag_gets_the_nearest_one(tmp_path, capsys):
    from lowbit.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["launch", "--num_procesess", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lowbit launch")
    assert "lowbit launch: error: unrecognized argument '--num_procesess'. Did you mean '--num_processes'?" in err


def test_an_error_in_a_rank_names_the_config_file_the_setting_came_from(tmp_path):
    pytest.importorskip("lowbit_ao")
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: fp8\nfp8_config:\n  backend: tee\n")
    proc = _run("-m", "lowbit.cli.main", "launch", "--config_file", str(config), str(SCRIPTS / "make_accelerator.py"))
    assert proc.returncode != 0
    assert (
        f"Unknown low-precision backend 'tee' (from config file {config}, fp8_config.backend). Did you mean 'te'?"
        in proc.stderr
    )


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "abc"}, r"WORLD_SIZE='abc' must be a whole number"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, r"RANK=3 and WORLD_SIZE=2 do not fit together"),
    ],
)
def test_rank_variables_are_checked_at_start(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        Accelerator(cpu=True)


def test_init_process_group_kwargs_reach_torch(monkeypatch):
    import torch.distributed as dist

    from lowbit.runtime import process_group

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(process_group.atexit, "register", lambda fn: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    process_group.init_process_group("cpu", {"backend": None, "timeout": 90, "init_method": None})
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=90)}
