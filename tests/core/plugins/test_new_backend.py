"""`lowbit new-backend NAME` writes a distribution whose own test passes once convert_model is
filled in (and fails, saying so, before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers import TESTS, install_entry_points

from lowbit.cli.main import main
from lowbit.cli.scaffold import FILL_IN_MARKER

CONVERT = '''import torch
    from torch import nn
    from torch.nn import functional as F

    class FakeFP8Linear(nn.Linear):
        def forward(self, x):
            scale = 448.0 / self.weight.detach().abs().amax().clamp(min=1e-12)
            rounded = (self.weight * scale).to(torch.float8_e4m3fn).to(self.weight.dtype) / scale
            return F.linear(x, self.weight + (rounded - self.weight).detach(), self.bias)

    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FakeFP8Linear  # same parameters, same values
    return model'''


def install_in_place(root: Path, site: Path) -> None:
    """What `pip install -e` leaves behind for discovery: a dist-info with the entry points."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    install_entry_points(site, project["name"], project["version"], project["entry-points"]["lowbit"])


def run_its_test(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(root)])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=1500,
    )


def assert_lints_clean(root: Path) -> None:
    """The generated distribution (core/lowbit/cli/scaffold.py's templates, filled in) passes
    the same linter as lowbit's own code: the templates are code in strings, checked here."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E9,F", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_the_scaffold_passes_its_own_test_after_filling_in_convert_model(tmp_path, capsys):
    assert main(["new-backend", "myfp8", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "lowbit-myfp8"
    assert "fill in convert_model" in capsys.readouterr().out
    module = root / "lowbit_myfp8" / "__init__.py"
    source = module.read_text()
    for hook in ("autocast_context", "wrap_optimizer", "export_state_dict", "prepare_model_and_optimizer"):
        assert f"def {hook}(" in source  # stubbed, with the hook's documentation
    assert "Called by:" in source
    install_in_place(root, tmp_path / "site")

    before = run_its_test(root, tmp_path / "site")
    assert before.returncode != 0 and "fill in convert_model" in before.stdout, before.stdout[-3000:]

    line = next(line for line in source.splitlines() if FILL_IN_MARKER in line)
    module.write_text(source.replace(line, "    " + CONVERT))
    after = run_its_test(root, tmp_path / "site")
    assert after.returncode == 0, after.stdout[-4000:] + after.stderr[-2000:]
    assert_lints_clean(root)
    assert "1 passed" in after.stdout


def test_bad_names_and_existing_directories_are_refused(tmp_path, capsys):
    assert main(["new-backend", "My-FP8", "--dir", str(tmp_path)]) == 2
    assert "must be lower case" in capsys.readouterr().err
    (tmp_path / "lowbit-taken").mkdir()
    assert main(["new-backend", "taken", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not any((tmp_path / "lowbit-taken").iterdir())


@pytest.mark.parametrize("hook", ["convert_model", "autocast_context"])
def test_the_stubs_are_valid_python_and_inactive(tmp_path, hook):
    from lowbit.cli.scaffold import module_text

    namespace: dict = {}
    exec(compile(module_text("okfp8"), "lowbit_okfp8", "exec"), namespace)  # noqa: S102 - our own template
    assert callable(namespace[hook])
    assert not hasattr(namespace["autocast_context"], "lowbit_impl")  # no @hookimpl: pluggy skips it


def test_a_scaffolded_strategy_trains_as_generated_under_lowbit_launch(tmp_path, capsys):
    """`--kind strategy`: installed through its entry point, its own test (the strategy kit: 2
    processes under `lowbit launch --distributed_type NAME`, against one process) passes as written."""
    assert main(["new-backend", "mystrat", "--kind", "strategy", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "lowbit-mystrat"
    assert "trains as written" in capsys.readouterr().out
    source = (root / "lowbit_mystrat" / "__init__.py").read_text()
    for hook in ("save_checkpoint", "backward", "full_state_dict"):
        assert f"def {hook}(" in source
    install_in_place(root, tmp_path / "site")
    result = run_its_test(root, tmp_path / "site")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert_lints_clean(root)
    assert "1 passed" in result.stdout


def test_a_scaffolded_backend_with_its_own_precision_name_trains(tmp_path):
    """`--precision fp4`: the backend declares "fp4", Accelerator(mixed_precision="fp4") reaches it,
    and its conformance kit (which trains in the precision the backend declares) passes."""
    assert main(["new-backend", "myfp4", "--precision", "fp4", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "lowbit-myfp4"
    module = root / "lowbit_myfp4" / "__init__.py"
    source = module.read_text()
    assert "precisions=('fp4',)" in source
    line = next(line for line in source.splitlines() if FILL_IN_MARKER in line)
    module.write_text(source.replace(line, "    " + CONVERT))
    install_in_place(root, tmp_path / "site")
    result = run_its_test(root, tmp_path / "site")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert_lints_clean(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(root)]), LOWBIT_MIXED_PRECISION="fp4")
    out = subprocess.run(
        [sys.executable, str(TESTS / "scripts" / "show_settings.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert out.stdout.split()[3:] == ["fp4", "myfp4", "none", "torch.bfloat16"], out.stdout + out.stderr[-2000:]


def test_a_precision_nobody_offers_is_an_error_with_the_nearest_name():
    from lowbit import Accelerator

    from lowbit.kernel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mixed_precision 'fp9'.*Did you mean 'fp8'"):
        Accelerator(mixed_precision="fp9")
    assert Accelerator(mixed_precision="fp32").mixed_precision == "no"
    assert Accelerator(mixed_precision="BFloat16").mixed_precision == "bf16"
    assert Accelerator(mixed_precision="float8").mixed_precision == "fp8"
