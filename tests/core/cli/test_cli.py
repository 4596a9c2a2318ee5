"""The `lowbit` command: plugins, env, config, launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TESTS

from lowbit.cli.main import main

SHOW_ENV = str(TESTS / "scripts" / "show_env.py")

LOWBIT = [sys.executable, "-m", "lowbit.cli.main"]


def run_cli(*args, env=None, cwd=None):
    return subprocess.run([*LOWBIT, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)


def test_plugins_json_lists_builtins_and_the_choice():
    proc = run_cli("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = {row["name"]: row for row in report["plugins"]}
    assert {"ddp", "fsdp"} <= set(names)
    assert names["ddp"]["distribution"] == "lowbit (built-in)"
    assert {"name", "distribution", "version", "role", "priority", "status", "reason", "chosen"} <= set(names["ddp"])
    assert report["hardware"] == "CPU"


def test_plugins_table_marks_the_choice(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "priority" in out and "mixed_precision='fp8'" in out


def test_env_prints_a_bug_report(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "- torch:" in out and "- Hardware:" in out and "- Config file:" in out and "- C++ compiler:" in out
    assert "- numpy:" in out and "GiB" in out.split("- RAM:")[1].splitlines()[0]
    assert "bf16" in out.split("- CPU:")[1].splitlines()[0]


def test_config_from_flags_round_trips_through_launch(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    assert (
        main(
            [
                "config",
                "--config_file",
                str(path),
                "--mixed_precision",
                "fp8",
                "--fp8_backend",
                "ao",
                "--gradient_accumulation_steps",
                "2",
            ]
        )
        == 0
    )
    data = yaml.safe_load(path.read_text())
    assert data["mixed_precision"] == "fp8" and data["gradient_accumulation_steps"] == 2
    assert data["fp8_config"] == {"backend": "ao"}
    proc = run_cli("launch", "--config_file", str(path), "--gradient_accumulation_steps", "3", SHOW_ENV)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["LOWBIT_MIXED_PRECISION"] == "fp8"
    assert env["LOWBIT_FP8_BACKEND"] == "ao"
    assert env["LOWBIT_GRADIENT_ACCUMULATION_STEPS"] == "3"  # the flag beats the file


def test_config_default_writes_defaults(tmp_path):
    path = tmp_path / "d.yaml"
    assert main(["config", "--default", "--config_file", str(path)]) == 0
    assert yaml.safe_load(path.read_text())["mixed_precision"] == "no"


def test_launch_missing_script_is_a_clear_error(tmp_path, capsys):
    assert main(["launch", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_launch_refuses_zero_processes(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["launch", "--num_processes", "0", str(script)]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_launch_refuses_fsdp_with_deepspeed(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["launch", "--use_fsdp", "--use_deepspeed", str(script)]) == 2
    assert "Choose one" in capsys.readouterr().err


def test_launch_port_in_use_is_a_clear_error(tmp_path, capsys):
    import socket

    script = tmp_path / "s.py"
    script.write_text("")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["launch", "--num_processes", "2", "--main_process_port", str(port), str(script)]) == 2
    assert "already in use" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_launch_two_processes_runs_torchrun_and_prints_the_command(tmp_path):
    proc = run_cli("launch", "--debug", "--cpu", "--num_processes", "2", SHOW_ENV, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "torch.distributed.run --nproc_per_node 2" in proc.stderr
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((e["RANK"], e["WORLD_SIZE"], e["LOWBIT_DISTRIBUTED_TYPE"]) for e in ranks) == [
        ("0", "2", "MULTI_CPU"),
        ("1", "2", "MULTI_CPU"),
    ]


def test_script_exit_code_is_passed_through(tmp_path):
    assert run_cli("launch", SHOW_ENV, "--exit", "3").returncode == 3


def test_ao_launch_flags_reach_the_script(tmp_path):
    pytest.importorskip("lowbit_ao")
    proc = run_cli(
        "launch", "--mixed_precision", "fp8", "--fp8_recipe", "rowwise", "--fp8_pad_inner_dim", "yes", SHOW_ENV
    )
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert (env["LOWBIT_FP8_RECIPE"], env["LOWBIT_FP8_PAD_INNER_DIM"]) == ("rowwise", "true")
    bad = run_cli("launch", "--fp8_recipe", "rowwize", SHOW_ENV)
    assert bad.returncode == 2 and "Did you mean 'rowwise'" in bad.stderr


def test_multi_machine_launch_uses_torchrun_rendezvous_arguments(tmp_path, monkeypatch):
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    args = build_parser().parse_args(
        [
            "launch",
            "--num_processes",
            "8",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.1.2.3",
            "--main_process_port",
            "29555",
            str(script),
            "--lr",
            "3",
        ]
    )
    command, env, _ = build_command(args)
    # --num_processes is the total over all machines, as in Accelerate: 8 over 2 machines is 4 each.
    # The script runs through lowbit's runner (transformers' Trainer then builds lowbit's Accelerator).
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "4",
        "--module",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "10.1.2.3",
        "--master_port",
        "29555",
        "lowbit.cli.run_script",
        str(script),
        "--lr",
        "3",
    ]
    # the run's settings reach the ranks; the launcher's (how many machines, where they meet) do not
    assert env["LOWBIT_DISTRIBUTED_TYPE"] == "MULTI_GPU" and "LOWBIT_NUM_MACHINES" not in env


LAUNCHER_ONLY_ENV = (
    "LOWBIT_NUM_PROCESSES",
    "LOWBIT_NUM_MACHINES",
    "LOWBIT_MACHINE_RANK",
    "LOWBIT_MAIN_PROCESS_IP",
    "LOWBIT_MAIN_PROCESS_PORT",
    "LOWBIT_RDZV_BACKEND",
    "LOWBIT_GPU_IDS",
    "LOWBIT_DEBUG",
)


def test_a_c10d_launch_exports_the_runs_settings_and_none_of_the_launchers(tmp_path, monkeypatch):
    """The launcher keeps its own record (LauncherSettings); a rank gets what the run reads, and
    learns its place from torchrun. The plugins are discovered once per launch."""
    import lowbit.cli.launch as launch_module
    from lowbit.cli.launch import build_command
    from lowbit.cli.main import build_parser

    import lowbit.run.plugin_manager as plugin_manager
    from lowbit.run.settings import TOP_LEVEL, LauncherSettings

    assert {TOP_LEVEL[name].env for name in LauncherSettings.__dataclass_fields__} == set(LAUNCHER_ONLY_ENV)
    discovered = []
    real = plugin_manager.build_plugin_manager
    monkeypatch.setattr(plugin_manager, "build_plugin_manager", lambda *a, **k: discovered.append(1) or real(*a, **k))
    monkeypatch.setattr(launch_module, "_check_c10d_endpoint", lambda host, port: None)  # no store to probe here
    monkeypatch.setattr(sys, "argv", ["lowbit", "launch"])
    script = tmp_path / "train.py"
    script.write_text("")
    flags = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--rdzv_backend", "c10d"]
    flags += ["--main_process_ip", "10.0.0.1", "--main_process_port", "29400", "--gpu_ids", "all", "--debug"]
    flags += ["--mixed_precision", "bf16", "--gradient_accumulation_steps", "2"]
    command, env, _ = build_command(build_parser().parse_args(["launch", *flags, str(script)]))
    assert command[command.index("--rdzv_endpoint") + 1] == "10.0.0.1:29400"
    assert (env["LOWBIT_MIXED_PRECISION"], env["LOWBIT_GRADIENT_ACCUMULATION_STEPS"]) == ("bf16", "2")
    assert sorted(set(env) & set(LAUNCHER_ONLY_ENV)) == []
    assert len(discovered) == 1


def test_multi_machine_launch_needs_the_main_ip(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", "--num_processes", "2", "--num_machines", "2", str(script)]) == 2
    assert "--main_process_ip" in capsys.readouterr().err


def test_plugins_lists_the_hooks_each_plugin_implements(capsys):
    from lowbit.cli.plugins_command import collect

    rows = {row["name"]: row for row in collect(cpu=True)["plugins"]}
    assert {"convert_model", "wrap_optimizer", "export_state_dict"} <= set(rows["ao"]["hooks"])
    assert "describe_backend" not in rows["ao"]["hooks"]
    assert main(["plugins", "--cpu"]) == 0
    assert "Hooks each plugin implements" in capsys.readouterr().out


def test_launch_runs_a_folder_by_its_main_as_python_does(tmp_path, capsys):
    """``python DIR``, torchrun and ``accelerate launch`` run a folder with a __main__.py (its own
    modules importable); ``lowbit launch DIR`` said the script "does not exist"."""
    import shutil

    app = shutil.copytree(Path(__file__).resolve().parents[2] / "fixtures" / "folder_app", tmp_path / "app")
    ran = subprocess.run(
        [sys.executable, "-m", "lowbit.cli.run_script", str(app), "x"], capture_output=True, text=True, timeout=600
    )
    assert ran.stdout.strip() == "ran 7 ['x']", ran.stderr[-2000:]
    (tmp_path / "empty").mkdir()
    assert main(["launch", str(tmp_path / "empty")]) == 2
    assert "is a folder without a __main__.py" in capsys.readouterr().err


def test_the_launcher_imports_no_torch(tmp_path):
    """``lowbit launch`` parses, reads the settings, discovers the plugins and builds torchrun's
    command without importing torch (about 2 CPU-seconds a launch): torchrun and the ranks import it."""
    script = tmp_path / "train.py"
    script.write_text("")
    done = subprocess.run(
        [sys.executable, str(TESTS / "scripts" / "modules_loaded.py"), "launch_command", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["torch"] is False
