"""Shared fixtures: every test runs with a clean lowbit environment and its own config dir."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# One thread per test process: pytest-xdist runs two workers on CI's two cores, and torch's default
# (a thread per core in each worker) put twice as many OpenMP threads as cores, whose spin-waiting
# cost five times the CPU (tests/plugins/ao/test_lora.py and test_block_formats.py: 104
# CPU-seconds, 19 with one thread). Set before torch is imported; the processes a test starts
# inherit it, and a test that sets its own keeps it. OMP_NUM_THREADS given outside stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported by a plugin before this file: too late for the variable alone
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def clean_lowbit_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("LOWBIT_"):
            monkeypatch.delenv(key)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    # Processes a test starts hold lowbit's collectives to NCCL's device rule (collective_device.py).
    monkeypatch.setenv("LOWBIT_SIMULATE_NCCL", "1")
    yield


@pytest.fixture(autouse=True)
def _each_test_hears_lowbits_notices():
    """lowbit says each notice once per process; every test is a fresh run as far as notices go."""
    from lowbit.kernel import notices

    notices.reset()
    yield


# ---------------------------------------------------------------------- the order tests start in

# Each test's seconds on CI's 2-core machine (tests of 2 s or more), written by a run with
# --record-seconds. With pytest-xdist (-n 2; pyproject's addopts send one test at a time to a free
# worker), the longest tests start first, so that no long test starts last while the other worker
# idles. Tests that share launches (tests/helpers.py's LaunchedOnce) need no order: whichever runs
# first launches, the others wait for its result.
SECONDS_FILE = Path(__file__).parent / "seconds.json"
RECORDED_FROM = 2.0


def pytest_addoption(parser):
    parser.addoption(
        "--record-seconds",
        action="store_true",
        help=f"write each test's seconds ({RECORDED_FROM:g} s or more) to {SECONDS_FILE.name}: the order later runs "
        "start tests in",
    )


def pytest_collection_modifyitems(config, items):
    known = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}
    items.sort(key=lambda item: -known.get(item.nodeid, 0.0))  # stable: the others keep their order


# ---------------------------------------------------------------------- where the time goes

_SECONDS_PER_FILE: dict[str, float] = {}
_SECONDS_PER_TEST: dict[str, float] = {}
_CPU_SECONDS_PER_FILE: dict[str, float] = {}
_CPU_AT_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """The CPU time of this process and of the processes it started and waited for (a launch: the
    launcher, torchrun and every rank): what a test costs on a busy machine as on an idle one."""
    import resource

    used = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(usage.ru_utime + usage.ru_stime for usage in used)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_AT_START] = _cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "teardown" and _CPU_AT_START in item.stash:  # the whole test: setup, call, teardown
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_CPU_AT_START]))
    return report


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown, summed per file (.ci/run's budgets read the summary)."""
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration
    _SECONDS_PER_TEST[report.nodeid] = _SECONDS_PER_TEST.get(report.nodeid, 0.0) + report.duration
    cpu = dict(report.user_properties).get("cpu_seconds")
    if cpu is not None:
        _CPU_SECONDS_PER_FILE[path] = _CPU_SECONDS_PER_FILE.get(path, 0.0) + cpu


def pytest_sessionfinish(session):
    """With --record-seconds: this run's long tests into SECONDS_FILE, in place of what it held for
    the files this run ran (a run of part of the suite updates its part)."""
    if not session.config.getoption("--record-seconds") or hasattr(session.config, "workerinput"):
        return
    known = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}
    files_run = {nodeid.split("::", 1)[0] for nodeid in _SECONDS_PER_TEST}
    known = {nodeid: s for nodeid, s in known.items() if nodeid.split("::", 1)[0] not in files_run}
    for nodeid, seconds in _SECONDS_PER_TEST.items():
        if seconds >= RECORDED_FROM:
            known[nodeid] = round(seconds, 1)
    SECONDS_FILE.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_PER_FILE:
        return
    total, cpu = sum(_SECONDS_PER_FILE.values()), sum(_CPU_SECONDS_PER_FILE.values())
    slowest = sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1])[:12]
    terminalreporter.write_sep("=", f"slowest test files ({total:,.0f} s in all; {cpu:,.0f} CPU-seconds)")
    for path, seconds in slowest:
        terminalreporter.write_line(
            f"{seconds:8.1f} s {_CPU_SECONDS_PER_FILE.get(path, 0.0):8.1f} CPU-s  {100 * seconds / total:4.1f}%  {path}"
        )
