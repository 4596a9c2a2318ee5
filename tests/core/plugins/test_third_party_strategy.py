"""A third-party distributed strategy plugs in like a built-in one: examples/third_party_strategy
(DDP with torch's ZeroRedundancyOptimizer), installed through its entry point as `pip install -e`
would, listed by `lowbit plugins`, chosen by name from the launcher, a config file and the env,
and passing the strategy conformance kit in 2 processes over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tomllib
from helpers import ROOT, install_entry_points, launch_argv, run_launch

from lowbit.conformance import run_strategy_conformance

EXAMPLE = ROOT / "examples" / "third_party_strategy"

WORKER = ROOT / "tests" / "distributed" / "zero_ddp_worker.py"


@pytest.fixture
def installed(tmp_path):
    """The example's entry point as pip leaves it, and the environment a launched process gets."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    install_entry_points(site, project["name"], project["version"], project["entry-points"]["lowbit"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(EXAMPLE), env.get("PYTHONPATH", "")])
    return env


def launch(env, tmp_path, *flags, config: str | None = None):
    extra = []
    if config is not None:
        (tmp_path / "config.yaml").write_text(config)
        extra = ["--config_file", str(tmp_path / "config.yaml")]
    proc = run_launch(
        launch_argv("--cpu", "--num_processes", "2", *extra, *flags, str(WORKER), str(tmp_path)),
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_lowbit_plugins_lists_it_with_what_it_is(installed):
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit.cli.main", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=installed,
        timeout=1500,
    )
    row = next(r for r in json.loads(proc.stdout)["plugins"] if r["name"] == "zero_ddp")
    assert row["distribution"] == "lowbit-zero-ddp" and row["role"] == "strategy" and row["status"] == "available"
    assert row["distributed_types"] == ["ZERO_DDP"] and row["config_section"] == "zero_ddp_config"
    assert row["launch_flag"] == "use_zero_ddp" and row["checkpoint"] == "own"


def test_it_passes_the_strategy_conformance_kit(installed, tmp_path):
    """Ranks agree, equal one process on the same global batch, and resume exactly."""
    result = run_strategy_conformance("zero_ddp", tmp_path, env=installed)
    assert result["ranks"][0]["distributed_type"] == "MULTI_CPU"  # it reports itself as data parallel


def test_chosen_from_a_config_file_with_its_own_section_and_the_state_is_sharded(installed, tmp_path):
    ranks = launch(
        installed, tmp_path, config="distributed_type: ZERO_DDP\nzero_ddp_config:\n  parameters_as_bucket_view: true\n"
    )
    assert [r["strategy"] for r in ranks] == ["zero_ddp", "zero_ddp"]
    assert {r["optimizer"] for r in ranks} == {"ZeroRedundancyOptimizer"}
    total = 2 * ranks[0]["params"]  # AdamW: two moments per parameter
    assert sum(r["local_state"] for r in ranks) == total and all(r["local_state"] < total for r in ranks)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_chosen_by_its_launch_switch_and_by_the_env(installed, tmp_path, how):
    if how == "flag":
        ranks = launch(installed, tmp_path, "--use_zero_ddp")
    else:
        ranks = launch({**installed, "LOWBIT_DISTRIBUTED_TYPE": "zero_ddp"}, tmp_path)
    assert [r["strategy"] for r in ranks] == ["zero_ddp", "zero_ddp"]


def test_a_misspelt_strategy_name_suggests_the_installed_one(installed, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    proc = subprocess.run(
        launch_argv("--cpu", "--num_processes", "2", "--distributed_type", "zero_dpp", str(script)),
        capture_output=True,
        text=True,
        env=installed,
        timeout=1500,
    )
    assert proc.returncode == 2 and "Did you mean 'zero_ddp'" in proc.stderr and "never runs" not in proc.stdout
