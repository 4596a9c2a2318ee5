"""Accelerate's own test suite, run against lowbit: every test of Accelerate's public API that
passes under Accelerate 1.15 passes under lowbit (the record: tests/accelerate_suite/passes.json,
written by `python tests/accelerate_suite/run_suite.py --record`). The tests come from Accelerate's
sdist, downloaded from the package registry when this runs; the imports are rewritten as a user
would (`accelerate` -> `lowbit`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import TESTS

sys.path.insert(0, str(TESTS / "accelerate_suite"))
import run_suite  # noqa: E402
from excluded import DELIBERATE_CHECKS, EXCLUDED, MODULES  # noqa: E402

# Runs another project's code (Trainer/TRL, Accelerate's own suite, transformers models): CI's third-party lane.
pytestmark = pytest.mark.third_party


def test_the_rewrite_renames_the_module_wherever_code_names_it_and_nothing_else():
    original = (TESTS / "fixtures" / "accelerate_imports.py").read_text().splitlines()
    rewritten = run_suite.rewrite("\n".join(original)).splitlines()
    statements = [
        i for i, line in enumerate(original) if line.split(" ")[0] in ("import", "from") and "accelerate" in line
    ]
    assert len(statements) == 3
    for i, line in enumerate(original):
        renamed = i in statements or line.startswith("TARGET")  # imports, and a mock.patch target's dotted path
        assert rewritten[i] == (line.replace("accelerate", "lowbit", 1) if renamed else line), line


def test_every_exclusion_names_a_recorded_test_and_says_why():
    recorded = run_suite.recorded()["accelerate"]
    for pattern, reason in EXCLUDED.items():
        assert pattern.split("::")[0] in MODULES, pattern
        assert any(t == pattern or t.startswith((pattern + "::", pattern + "[")) for t in recorded), f"stale: {pattern}"
        assert len(reason) > 30, pattern


def from_the_sdist(fetch):
    """``fetch()``'s folder from Accelerate's sdist; skipped where it cannot be downloaded, but in CI."""
    try:
        return fetch()
    except subprocess.CalledProcessError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Accelerate's sdist could not be downloaded here (offline?): {exc}")


def test_accelerates_public_api_tests_pass_under_lowbit(tmp_path):
    tests = from_the_sdist(run_suite.fetch_tests)
    folder = run_suite.copy_tests(tests, tmp_path / "lowbit", "lowbit")
    ours = run_suite.run_modules(folder, "lowbit", sys.executable, timeout=1500)
    print("\n".join(run_suite.table({"lowbit": ours})))
    unimportable = sorted(t for t, outcome in ours.items() if "::" not in t and outcome == "error")
    assert not unimportable, f"with imports rewritten, these modules do not import under lowbit: {unimportable}"
    expected = run_suite.public_passing(run_suite.recorded()["accelerate"])
    failing = sorted(t for t in expected if ours.get(t) != "passed")
    assert not failing, (
        f"{len(failing)} of Accelerate's {len(expected)} public-API tests that pass under Accelerate do "
        f"not pass under lowbit (rerun: python tests/accelerate_suite/run_suite.py): {failing}"
    )


def test_every_script_check_that_passes_under_accelerate_passes_under_lowbit(tmp_path):
    """The checks of Accelerate's launched scripts (test_script, test_sync, test_ops), one by one
    on 2 CPU processes: each that passed under Accelerate (recorded in passes.json by
    `run_suite.py --record`) passes under lowbit, but for the deliberate differences listed."""
    scripts = from_the_sdist(run_suite.fetch_scripts)
    folder = run_suite.copy_scripts(scripts, tmp_path / "scripts", "lowbit")
    ours = run_suite.run_script_checks(folder, "lowbit", sys.executable, timeout=600)
    print("\n".join(run_suite.script_table({"lowbit": ours})))
    reference = run_suite.recorded()["scripts"]["accelerate"]
    expected = [check for check, outcome in reference.items() if outcome == "passed" and check not in DELIBERATE_CHECKS]
    assert len(expected) >= 30, "the recorded Accelerate run counted too few checks: re-record it"
    failing = {check: ours.get(check) for check in expected if ours.get(check) != "passed"}
    assert not failing, (
        f"{len(failing)} of the {len(expected)} script checks that pass under Accelerate fail under lowbit: {failing}"
    )
    for check in DELIBERATE_CHECKS:
        assert reference.get(check) == "passed", f"stale: {check}"
