"""The README's set-up commands are the ones CI runs, and its examples exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in first_block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert text.index("```bash") < 30, "the set-up commands come first"
    commands = readme_setup_commands()
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and "examples/char_gpt.py" in commands[0]
    assert "torch==2.13.0" in commands[1] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_setup_commands()[1] in ci.splitlines()


def test_files_the_readme_names_exist():
    text = (ROOT / "README.md").read_text()
    for path in re.findall(r"\]\(([^)#]+)\)", text):
        if not path.startswith("http"):
            assert (ROOT / path).exists(), path
