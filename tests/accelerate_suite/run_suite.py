"""Run Accelerate's own test suite against lowbit, side by side with Accelerate.

The tests are those of the pinned Accelerate release's sdist, fetched from the package registry
when this runs and never committed; this file holds only the rewriting and the counting.

    python tests/accelerate_suite/run_suite.py                    # lowbit, per module
    python tests/accelerate_suite/run_suite.py --library both     # and Accelerate itself, beside it
    python tests/accelerate_suite/run_suite.py --record           # write the expected lists (passes.json)

``lowbit`` runs the modules with their imports rewritten as a user would (``accelerate`` ->
``lowbit``); ``accelerate`` runs them as shipped. A test of Accelerate's internals (its CLI's
Python functions, classes its docs call internal, private attributes) is listed in
``excluded.py`` with the reason, and not counted. Results: one line per module, then the totals,
and a JSON file of every test's outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from excluded import EXCLUDED, MODULES  # noqa: E402

VERSION = "1.15.0"
PASSES_FILE = HERE / "passes.json"
# The sdist is cached here between runs (override with LOWBIT_ACCELERATE_SDIST_DIR).
CACHE = Path(os.environ.get("LOWBIT_ACCELERATE_SDIST_DIR") or Path(tempfile.gettempdir()) / "lowbit-accelerate-sdist")
# A module name followed by a dot or ending an import: ``from accelerate.utils import``,
# ``import accelerate``, ``"accelerate.utils.memory.torch"`` in a mock.patch target.
_MODULE_NAME = re.compile(r"(?<![\w.\-/])accelerate(?=\.\w|\s+import\b|\s*$|\s*#|\s+as\b|,)", re.M)


def fetch_tests(version: str = VERSION) -> Path:
    """The ``tests/`` folder of Accelerate's sdist ``version``, downloaded once."""
    target = CACHE / f"accelerate-{version}"
    if (target / "tests").is_dir():
        return target / "tests"
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-q",
            "-d",
            str(CACHE),
            f"accelerate=={version}",
        ],
        check=True,
    )
    with tarfile.open(CACHE / f"accelerate-{version}.tar.gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(f"accelerate-{version}/tests/")]
        archive.extractall(CACHE, members=members, filter="data")
    return target / "tests"


SCRIPTS = ("test_script", "test_sync", "test_ops")  # Accelerate's launched scripts whose checks run here


def fetch_scripts(version: str = VERSION) -> Path:
    """The folder of Accelerate's launched test scripts (``src/accelerate/test_utils/scripts``) from
    the same sdist, extracted once."""
    fetch_tests(version)
    folder = f"accelerate-{version}/src/accelerate/test_utils/scripts"
    target = CACHE / folder
    if not all((target / f"{name}.py").is_file() for name in SCRIPTS):
        with tarfile.open(CACHE / f"accelerate-{version}.tar.gz") as archive:
            members = [m for m in archive.getmembers() if m.name in {f"{folder}/{name}.py" for name in SCRIPTS}]
            archive.extractall(CACHE, members=members, filter="data")
    return target


def copy_scripts(scripts: Path, target: Path, library: str) -> Path:
    """The launched scripts in a folder of their own, rewritten for lowbit."""
    target.mkdir(parents=True, exist_ok=True)
    for name in SCRIPTS:
        source = (scripts / f"{name}.py").read_text()
        (target / f"{name}.py").write_text(rewrite(source) if library == "lowbit" else source)
    return target


def run_script_checks(folder: Path, library: str, python: str, timeout: float) -> dict[str, str]:
    """Every check of the launched scripts on 2 CPU processes: ``script::check`` -> "passed", or
    "failed: ..." (as the first process to fail said it). A failing check ends its launch; the next
    launch starts at the check after it."""
    from script_checks import CHECKS, IMPORT_FAILED, check_id

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWBIT_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    if library == "lowbit":
        env["LOWBIT_SIMULATE_NCCL"] = "1"
        launcher = [python, "-m", "lowbit.cli.main", "launch", "--cpu", "--num_processes", "2"]
    else:  # what `accelerate launch --cpu --num_processes 2` sets (without ACCELERATE_USE_CPU it reads no group)
        env["ACCELERATE_USE_CPU"] = "true"
        launcher = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    outcomes: dict[str, str] = {}
    for script, checks in CHECKS.items():
        out = folder / f"outcomes-{script}"
        out.mkdir(parents=True, exist_ok=True)
        start = 0
        while start < len(checks):
            command = [
                *launcher,
                str(HERE / "script_checks.py"),
                "--library",
                library,
                "--scripts",
                str(folder),
                "--script",
                script,
                "--from_check",
                str(start),
                "--out",
                str(out),
            ]
            try:
                subprocess.run(
                    command, cwd=folder, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            except subprocess.TimeoutExpired:
                pass
            ranks = [json.loads(path.read_text()) for path in sorted(out.glob(f"{script}_rank*.json"))]
            broken = next((rank[IMPORT_FAILED] for rank in ranks if IMPORT_FAILED in rank), None)
            if broken:
                outcomes.update({f"{script}::{check_id(*check)}": broken for check in checks[start:]})
                break
            reached = start
            for index in range(start, len(checks)):
                key = check_id(*checks[index])
                said = [rank.get(key) for rank in ranks]
                if said and all(outcome == "passed" or str(outcome).startswith("skipped") for outcome in said):
                    outcomes[f"{script}::{key}"] = said[0]
                    reached = index + 1
                    continue
                failed = next(
                    (o for o in said if o and o.startswith("failed")), "failed: no outcome (stopped, or timed out)"
                )
                outcomes[f"{script}::{key}"] = failed
                reached = index + 1
                break
            start = reached
    return outcomes


def rewrite(source: str) -> str:
    """``accelerate`` -> ``lowbit`` wherever the text names the module (imports, dotted paths)."""
    return _MODULE_NAME.sub("lowbit", source)


def copy_tests(tests: Path, target: Path, library: str) -> Path:
    """The modules to run, in a folder of their own, rewritten for lowbit."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(tests, target)
    if library == "lowbit":
        for path in target.rglob("*.py"):
            path.write_text(rewrite(path.read_text()))
    return target


def run_modules(folder: Path, library: str, python: str, timeout: float) -> dict[str, str]:
    """Every test's outcome (passed, failed, error, skipped), by ``module::Class::test`` id."""
    report = folder / f"junit-{library}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWBIT_"))}
    env.update(PYTHONPATH=str(folder), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--junitxml={report}",
        "--continue-on-collection-errors",
        "--rootdir",
        str(folder),
        *[str(folder / m) for m in MODULES],
    ]
    subprocess.run(command, cwd=folder, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes: dict[str, str] = {}
    if not report.exists():
        return outcomes
    for case in ET.parse(report).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        if not module:  # a function at module level
            module, cls = cls, ""
        test_id = "::".join(p for p in (module.split(".")[-1] + ".py", cls, case.get("name")) if p)
        kinds = {child.tag for child in case}
        outcomes[test_id] = (
            "failed"
            if "failure" in kinds
            else "error"
            if "error" in kinds
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
    return outcomes


def script_table(results: dict[str, dict[str, str]]) -> list[str]:
    """Per launched script: its checks that pass under Accelerate (not excluded), and how many of
    them pass under lowbit."""
    from excluded import DELIBERATE_CHECKS

    reference = results.get("accelerate") or recorded()["scripts"]["accelerate"]
    ours = results.get("lowbit", {})
    lines = [f"{'script':32} {'accelerate':>10} {'lowbit':>7} {'excluded':>9}"]
    total = [0, 0, 0]
    for script in SCRIPTS:
        ids = [c for c, outcome in reference.items() if c.startswith(script + "::") and outcome == "passed"]
        counted = [c for c in ids if c not in DELIBERATE_CHECKS]
        passing = [c for c in counted if ours.get(c) == "passed"]
        total = [total[0] + len(counted), total[1] + len(passing), total[2] + len(ids) - len(counted)]
        lines.append(f"{script:32} {len(counted):>10} {len(passing):>7} {len(ids) - len(counted):>9}")
    lines.append(f"{'all':32} {total[0]:>10} {total[1]:>7} {total[2]:>9}")
    lines.append(
        "script checks, run one by one on 2 CPU processes: accelerate: checks that pass under Accelerate; lowbit: "
        "how many of them pass under lowbit; excluded: tests/accelerate_suite/excluded.py DELIBERATE_CHECKS"
    )
    return lines


def excluded_reason(test_id: str) -> str | None:
    for pattern, reason in EXCLUDED.items():
        if test_id == pattern or test_id.startswith((pattern + "::", pattern + "[")):
            return reason
    return None


def public_passing(reference: dict[str, str]) -> list[str]:
    """The tests that pass under Accelerate and test its public API (not excluded)."""
    return [t for t, outcome in reference.items() if outcome == "passed" and excluded_reason(t) is None]


def recorded() -> dict[str, dict[str, str]]:
    return json.loads(PASSES_FILE.read_text())


def table(results: dict[str, dict[str, str]]) -> list[str]:
    """Per module: public-API tests passing under Accelerate, and how many of them pass under lowbit."""
    lines = [f"{'module':32} {'accelerate':>10} {'lowbit':>7} {'excluded':>9}"]
    reference = results.get("accelerate") or recorded()["accelerate"]
    ours = results.get("lowbit", {})
    total = [0, 0, 0]
    for module in MODULES:
        ids = [t for t in reference if t.startswith(module + "::")]
        public = [t for t in public_passing(reference) if t in ids]
        passing = [t for t in public if ours.get(t) == "passed"]
        excluded = [t for t in ids if excluded_reason(t) is not None and reference[t] == "passed"]
        total = [total[0] + len(public), total[1] + len(passing), total[2] + len(excluded)]
        lines.append(f"{module:32} {len(public):>10} {len(passing):>7} {len(excluded):>9}")
    lines.append(f"{'all':32} {total[0]:>10} {total[1]:>7} {total[2]:>9}")
    lines.append(
        "accelerate: public-API tests that pass under Accelerate; lowbit: how many of them pass under lowbit; "
        "excluded: tests that pass under Accelerate and are not counted (tests/accelerate_suite/excluded.py)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", choices=("lowbit", "accelerate", "both"), default="lowbit")
    parser.add_argument("--work", default=None, help="folder for the copied tests (default: a temporary one)")
    parser.add_argument("--out", default=None, help="write every test's outcome here as JSON")
    parser.add_argument("--record", action="store_true", help="run both and write tests/accelerate_suite/passes.json")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds for each library's run")
    args = parser.parse_args(argv)
    libraries = ("accelerate", "lowbit") if args.record or args.library == "both" else (args.library,)
    tests = fetch_tests()
    work = Path(args.work or tempfile.mkdtemp(prefix="accelerate-suite-"))
    results: dict[str, dict[str, str]] = {}
    for library in libraries:
        start = time.perf_counter()
        print(f"running Accelerate {VERSION}'s tests under {library} ...", flush=True)
        results[library] = run_modules(
            copy_tests(tests, work / library, library), library, sys.executable, args.timeout
        )
        print(f"  {len(results[library])} tests in {time.perf_counter() - start:.0f} s", flush=True)
    scripts = fetch_scripts()
    checks: dict[str, dict[str, str]] = {}
    for library in libraries:
        start = time.perf_counter()
        print(f"running the checks of Accelerate {VERSION}'s launched scripts under {library} ...", flush=True)
        folder = copy_scripts(scripts, work / f"{library}-scripts", library)
        checks[library] = run_script_checks(folder, library, sys.executable, args.timeout)
        print(f"  {len(checks[library])} checks in {time.perf_counter() - start:.0f} s", flush=True)
    print("\n".join(table(results)))
    print("\n".join(script_table(checks)))
    if args.out:
        Path(args.out).write_text(json.dumps({"tests": results, "scripts": checks}, indent=1, sort_keys=True))
    if args.record:
        PASSES_FILE.write_text(
            json.dumps(
                {
                    "version": VERSION,
                    **{lib: {t: o for t, o in sorted(r.items())} for lib, r in results.items()},
                    "scripts": {lib: dict(sorted(r.items())) for lib, r in checks.items()},
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
