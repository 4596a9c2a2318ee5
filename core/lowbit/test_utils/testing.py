"""Helpers for a user's tests, at Accelerate's ``accelerate.test_utils.testing`` path.

``require_<what>`` decorators skip a test (unittest or pytest) when this machine lacks what it
needs; ``AccelerateTestCase`` resets the process-wide state after each test; ``TempDirTestCase``
gives a class one scratch folder, emptied before each test; ``execute_subprocess_async`` and
``run_command`` run a command and raise with its output when it fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from lowbit.compat.utils.versions import is_torch_version


def _device() -> tuple[str, int, Callable[[], int]]:
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu", torch.xpu.device_count(), torch.xpu.memory_allocated
    return "cpu", 1, lambda: 0


# The device tests run on, how many there are, and how to read the memory allocated on it.
torch_device, device_count, memory_allocated_func = _device()


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _skip_unless(condition: bool, reason: str) -> Callable[[Any], Any]:
    return unittest.skipUnless(condition, reason)


def skip(test_case: Any) -> Any:
    """Always skipped."""
    return unittest.skip("marked skip")(test_case)


def slow(test_case: Any) -> Any:
    """Runs only with RUN_SLOW=1."""
    return _skip_unless(_flag("RUN_SLOW"), "slow: set RUN_SLOW=1 to run")(test_case)


def run_first(test_case: Any) -> Any:
    """Ordered first where pytest-order is installed (tests that launch subprocesses); otherwise as is."""
    if _installed("pytest_order"):
        import pytest

        return pytest.mark.order(1)(test_case)
    return test_case


_ON_GPU = torch_device == "cuda"
_CAPABILITY = torch.cuda.get_device_capability() if _ON_GPU else (0, 0)
# name -> (whether this machine has it, why a test is skipped without it)
_REQUIREMENTS: dict[str, tuple[bool, str]] = {
    "cpu": (torch_device == "cpu", "needs to run on the CPU"),
    "non_cpu": (torch_device != "cpu", "needs a GPU or another accelerator"),
    "cuda": (_ON_GPU, "needs a CUDA GPU"),
    "cuda_or_xpu": (torch_device in ("cuda", "xpu"), "needs a CUDA or XPU device"),
    "cuda_or_hpu": (_ON_GPU, "needs a CUDA or HPU device"),
    "xpu": (torch_device == "xpu", "needs an XPU"),
    "non_xpu": (torch_device != "xpu", "does not run on an XPU"),
    "non_hpu": (True, "does not run on an HPU"),
    "non_torch_xla": (not _installed("torch_xla"), "does not run under torch_xla"),
    "tpu": (False, "needs a TPU (lowbit does not train on TPUs)"),
    "mps": (torch.backends.mps.is_available(), "needs Apple's MPS"),
    "fp16": (torch_device != "cpu", "needs a device with fp16 kernels"),
    "fp8": (_CAPABILITY >= (8, 9), "needs a GPU with FP8 tensor cores (compute capability 8.9+)"),
    "single_device": (torch_device != "cpu" and device_count == 1, "needs exactly one accelerator"),
    "single_gpu": (_ON_GPU and device_count == 1, "needs exactly one GPU"),
    "multi_device": (torch_device != "cpu" and device_count > 1, "needs several accelerators"),
    "multi_gpu": (_ON_GPU and device_count > 1, "needs several GPUs"),
    "multi_gpu_or_xpu": (torch_device in ("cuda", "xpu") and device_count > 1, "needs several GPUs or XPUs"),
    "huggingface_suite": (_installed("transformers", "datasets"), "needs transformers and datasets"),
    "transformer_engine": (_installed("transformer_engine"), "needs Transformer Engine"),
    "transformer_engine_mxfp8": (
        _installed("transformer_engine") and _CAPABILITY >= (10, 0),
        "needs Transformer Engine on a GPU with MXFP8 (compute capability 10.0+)",
    ),
    "torchdata_stateful_dataloader": (_installed("torchdata"), "needs torchdata's StatefulDataLoader"),
    "trackers": (_installed("wandb") or _installed("tensorboard") or _installed("comet_ml"), "needs a tracker library"),
    "import_timer": (_installed("import_timer"), "needs import-timer"),
    "pippy": (False, "needs PiPPy (lowbit does not offer pipeline parallelism)"),
    "fsdp2": (True, "needs FSDP2"),
    "tp": (True, "needs tensor parallelism"),
}
# Libraries a test may need, by the name of their decorator.
_LIBRARIES = {
    "datasets": "datasets",
    "transformers": "transformers",
    "timm": "timm",
    "torchvision": "torchvision",
    "triton": "triton",
    "schedulefree": "schedulefree",
    "bnb": "bitsandbytes",
    "deepspeed": "deepspeed",
    "torchao": "torchao",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
    "comet_ml": "comet_ml",
    "aim": "aim",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "pandas": "pandas",
    "mlflow": "mlflow",
    "matplotlib": "matplotlib",
}
_REQUIREMENTS.update({name: (_installed(module), f"needs {module}") for name, module in _LIBRARIES.items()})


def _requirement(name: str) -> Callable[[Any], Any]:
    has, reason = _REQUIREMENTS[name]

    def decorator(test_case: Any) -> Any:
        return _skip_unless(has, reason)(test_case)

    decorator.__name__ = decorator.__qualname__ = f"require_{name}"
    decorator.__doc__ = f"Skips the test unless this machine has what it {reason}."
    return decorator


globals().update({f"require_{name}": _requirement(name) for name in _REQUIREMENTS})


def require_torch_min_version(test_case: Any = None, version: str | None = None) -> Any:
    """Skips the test on torch older than ``version`` (also as ``@require_torch_min_version(version=...)``)."""
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    return _skip_unless(is_torch_version(">=", version), f"needs torch >= {version}")(test_case)


def get_launch_command(**kwargs: Any) -> list[str]:
    """``["lowbit", "launch", "--num_processes=2", ...]`` from keyword arguments (a True flag stands alone)."""
    command = ["lowbit", "launch"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value is not None and value is not False:
            command.append(f"--{key}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count)


def get_torch_dist_unique_port() -> int:
    """A rendezvous port, offset by the pytest-xdist worker number so parallel workers do not clash."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return 29500 + (int(worker) if worker.isdigit() else 0)


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed lowbit package (Accelerate's name for the same helper)."""
    return Path(__file__).resolve().parents[1].joinpath(*components)


class TempDirTestCase(unittest.TestCase):
    """One temporary folder per test class (``self.tmpdir``), emptied before each test unless
    ``clear_on_setup`` is False, removed after the class."""

    clear_on_setup = True
    tmpdir: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in self.tmpdir.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """Resets the process-wide state after each test, so one test's Accelerator does not leak into the next."""

    def tearDown(self) -> None:
        super().tearDown()
        from lowbit.compat.state import AcceleratorState

        AcceleratorState._reset_state(True)


class MockingTestCase(unittest.TestCase):
    """Call ``self.add_mocks(patcher or [patchers])`` in ``setUp``: each is started and stopped after the test."""

    def add_mocks(self, mocks: Any) -> None:
        self.mocks = list(mocks) if isinstance(mocks, (list, tuple)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


@contextlib.contextmanager
def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Iterator[None]:
    """The block must raise ``exception_class`` (with ``msg`` in its text, when given)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the type is checked just below
        assert isinstance(exc, exception_class), f"expected {exception_class.__name__}, got {type(exc).__name__}: {exc}"
        assert msg is None or msg in str(exc), f"expected {msg!r} in the message, got {str(exc)!r}"
        return
    raise AssertionError(f"expected {exception_class.__name__}, but the block raised nothing")


def capture_call_output(func: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What ``func(*args, **kwargs)`` printed to stdout."""
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        func(*args, **kwargs)
    return captured.getvalue()


class SubprocessCallException(Exception):
    """A command run by :func:`run_command` failed; the message holds its output."""


def run_command(command: list[Any], return_stdout: bool = False, env: dict[str, str] | None = None) -> str | None:
    """Run ``command``; raise SubprocessCallException with its output when it fails."""
    command = [str(part) for part in command]
    try:
        output = subprocess.check_output(command, stderr=subprocess.STDOUT, env=env or os.environ.copy())
    except subprocess.CalledProcessError as exc:
        raise SubprocessCallException(f"`{' '.join(command)}` failed:\n\n{exc.output.decode()}") from exc
    return output.decode() if return_stdout else None


class _RunOutput:
    def __init__(self, returncode: int, stdout: list[str], stderr: list[str]):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def execute_subprocess_async(
    cmd: list[Any],
    env: dict[str, str] | None = None,
    stdin: Any = None,
    timeout: float = 180,
    quiet: bool = False,
    echo: bool = True,
) -> _RunOutput:
    """Run ``cmd`` (printing its output unless ``quiet``); raise RuntimeError with its stderr when it fails."""
    cmd = [str(part) for part in cmd]
    if echo:
        print("running:", " ".join(cmd))
    result = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout)
    if not quiet:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    if result.returncode > 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed with return code {result.returncode}; its stderr:\n{result.stderr}"
        )
    return _RunOutput(result.returncode, result.stdout.splitlines(), result.stderr.splitlines())


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds the same values on every process (one gather)."""
    from lowbit.runtime.training.operations import gather

    everyone = gather(tensor.detach()[None].clone()).cpu()
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


__all__ = [
    "torch_device",
    "device_count",
    "memory_allocated_func",
    "skip",
    "slow",
    "run_first",
    "are_the_same_tensors",
    *(f"require_{name}" for name in _REQUIREMENTS),
    "require_torch_min_version",
    "get_launch_command",
    "DEFAULT_LAUNCH_COMMAND",
    "get_torch_dist_unique_port",
    "path_in_accelerate_package",
    "TempDirTestCase",
    "AccelerateTestCase",
    "MockingTestCase",
    "assert_exception",
    "capture_call_output",
    "SubprocessCallException",
    "run_command",
    "execute_subprocess_async",
]
