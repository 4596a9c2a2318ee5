"""Small models and in-test plugins used across the test suite."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from lowbit import hookimpl

from lowbit.kernel.recipes import RecipeKwargs, recipe_option
from lowbit.kernel.types import BackendDescription

from lowbit.run.plugin_manager import make_plugin_manager

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_llama(seed: int = 0, **overrides):
    """A Llama from transformers with random weights (no download): ``TINY_LLAMA``'s shape, any field
    overridden; the weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides}))


def mlp(seed: int = 0, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 8),
    )


class TiedLM(nn.Module):
    """A head tied to the embedding, as Llama's ``tie_word_embeddings`` and GPT-2's ``lm_head``."""

    def __init__(self, vocab: int = 32, width: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


def regression_data(n: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    return x, x @ w / 4


class FakeBackend:
    """An FP8 backend that records every hook call made to it."""

    def __init__(self, name: str, priority: int, available: bool = True, reason: str = "", options_class=None):
        self.name, self.priority, self.available, self.reason = name, priority, available, reason
        self.options_class = options_class
        self.calls: list[str] = []

    @hookimpl
    def describe_backend(self, hardware):
        return BackendDescription(self.name, self.priority, self.available, self.reason, self.options_class)

    @hookimpl
    def convert_model(self, model, context):
        self.calls.append("convert_model")
        return model

    @hookimpl
    def wrap_optimizer(self, optimizer, model, context):
        self.calls.append("wrap_optimizer")
        return optimizer

    @hookimpl
    def autocast_context(self, model, context):
        self.calls.append("autocast_context")
        return contextlib.nullcontext  # a context factory: called on every forward


class BrokenOnDescribe:
    @hookimpl
    def describe_backend(self, hardware):
        raise RuntimeError("boom while checking availability")


def manager_with(*plugins, load_entry_points: bool = False):
    return make_plugin_manager(load_entry_points=load_entry_points, extra_plugins=plugins)


from dataclasses import dataclass  # noqa: E402
from typing import ClassVar  # noqa: E402


@dataclass
class FakeRecipe(RecipeKwargs):
    backend_name: ClassVar[str] = "fake"
    margin: int | None = recipe_option(0, type=int)
    fp8_format: str | None = recipe_option("HYBRID", choices=("HYBRID", "E4M3", "E5M2"))


class HardwareDetector:
    """Reports the given hardware, ahead of the built-in detector. With device_type "cpu" and a
    compute capability, tensors stay on the CPU while backends see an FP8-capable GPU."""

    def __init__(self, hardware):
        self.hardware = hardware

    @hookimpl(tryfirst=True)
    def detect_hardware(self, cpu):
        return self.hardware


def train_on_gpu(model: nn.Module, precision: str, handlers: list, shape: tuple[int, ...], steps: int):
    """Prepare ``model`` (moved to CUDA) with AdamW and train ``steps`` full-batch MSE steps on
    fixed random data of ``shape`` (last dim: the model's width). Returns (accelerator, model, losses)."""
    from lowbit import Accelerator
    from lowbit.cli.self_test import train_steps

    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    low_precision = precision not in ("no", "bf16", "fp16")  # fp8, fp4: the recipe handlers apply
    accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers if low_precision else [])
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(*shape, device="cuda", generator=generator)
    y = torch.randn(*shape, device="cuda", generator=generator)
    return accelerator, model, train_steps(accelerator, model, optimizer, x, y, steps)


def needs_fp8_gpu_with(module: str, label: str):
    """Mark a test that needs a CUDA sm_89+ GPU and the real ``module``.

    Skipped without such a GPU or without the library; a library that is installed but fails to
    import fails the test with its import error (a broken install is not "not here")."""
    import functools
    import importlib
    import importlib.util

    import pytest

    gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    installed = importlib.util.find_spec(module.split(".")[0]) is not None
    missing = []
    if not gpu:
        found = (
            f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
            if torch.cuda.is_available()
            else "no CUDA GPU"
        )
        missing.append(f"a CUDA GPU with compute capability >= 8.9 (found: {found})")
    if not installed:
        missing.append(f"{label} (not installed)")
    reason = "needs " + " and ".join(missing)

    def mark(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - report whatever the import raised
                pytest.fail(f"{label} is installed but does not import: {type(exc).__name__}: {exc}")
            return test(*args, **kwargs)

        return pytest.mark.gpu(pytest.mark.skipif(not (gpu and installed), reason=reason)(run))

    return mark


def launch_argv(*args: str) -> list[str]:
    """``lowbit launch ARGS...`` as a subprocess command, run by this interpreter."""
    import sys

    return [sys.executable, "-m", "lowbit.cli.main", "launch", *args]


def run_launch(cmd, *, env, cwd=None, timeout=1500):
    """Run a (multi-process) launch once, under NCCL's device rule. PYTHONFAULTHANDLER is on so that
    a crash of any rank, including an abort in interpreter shutdown, prints every thread's Python
    stack in the failure."""
    import subprocess

    from lowbit.runtime.collective_device import SIMULATE_ENV

    # Every multi-process test holds lowbit's collectives to NCCL's device rule (see collective_device.py).
    env = {**env, "PYTHONFAULTHANDLER": "1", SIMULATE_ENV: env.get(SIMULATE_ENV, "1")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def run_scenarios(run) -> None:
    """A worker's command line, ``SCENARIO[,...] OUT_DIR``: ``run(scenario, OUT_DIR / scenario)`` for
    each scenario in turn, in this one launch (tests share a launch's start-up this way)."""
    import sys

    scenarios, folder = sys.argv[1], Path(sys.argv[2])
    for scenario in scenarios.split(","):
        out = folder / scenario
        out.mkdir(parents=True, exist_ok=True)
        run(scenario, out)


class LaunchedOnce:
    """Launches shared by a module's tests, each run once per test session: under pytest-xdist by
    the first worker that asks, while the others wait for it (a file lock) and read its result.
    ``launch(folder)`` runs in an empty folder of the session's and returns what JSON can hold."""

    def __init__(self, tmp_path_factory, name: str):
        import os

        base = tmp_path_factory.getbasetemp()
        # each xdist worker has a temporary folder of its own, in one folder for the session
        self.root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
        self.root.mkdir(exist_ok=True)

    def __call__(self, key: tuple, launch):
        import hashlib
        import json
        import shutil

        from filelock import FileLock

        name = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
        folder, result = self.root / name, self.root / f"{name}.json"
        with FileLock(str(self.root / f"{name}.lock")):
            if not result.exists():  # a launch that failed left no result: this test launches it again
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                result.write_text(json.dumps(launch(folder)))
            return json.loads(result.read_text())


def install_entry_points(
    site, distribution: str, version: str, entry_points: dict[str, str], requires: tuple[str, ...] = ()
):
    """What `pip install` leaves for discovery: ``site/<dist>-<version>.dist-info`` with the
    distribution's metadata (``requires``: its Requires-Dist lines) and its ``lowbit`` entry
    points (put ``site`` on the path to use it)."""
    from pathlib import Path

    info = Path(site) / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    requirements = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n{requirements}")
    if entry_points:
        lines = "".join(f"{name} = {module}\n" for name, module in entry_points.items())
        (info / "entry_points.txt").write_text("[lowbit]\n" + lines)
    return info


# The tests folder and the repository: tests under tests/core/<subpackage>/ find their scripts through these.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PLUGIN_FIXTURES = TESTS / "fixtures" / "plugins"


def install_plugin_module(site, module: str, source: str | None = None) -> Path:
    """Copy tests/fixtures/plugins/<source or module>.py into ``site`` as ``<module>.py``."""
    import shutil

    target = Path(site) / f"{module}.py"
    shutil.copy(PLUGIN_FIXTURES / f"{source or module}.py", target)
    return target


def said(recwarn) -> str:
    """What lowbit printed as notices during a test, as it prints them ("lowbit: note: ...")."""
    from lowbit.kernel.notices import format_notice

    return "".join(format_notice(w.message, w.category) or "" for w in recwarn)


class Counter:
    """An object registered for checkpointing: a number it saves and restores."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]
