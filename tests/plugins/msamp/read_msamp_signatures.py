"""Write ``msamp_signatures.json``: the MS-AMP signatures lowbit depends on, read from its source.

MS-AMP is not on PyPI and needs CUDA, so its stand-in (``standin_msamp.py``) is checked against
this manifest instead of the library. To refresh it from a clone of Azure/MS-AMP:

    python tests/plugins/msamp/read_msamp_signatures.py /path/to/MS-AMP v0.4.0 main

Each revision is read with ``git show`` and ``ast`` (nothing imported); the signatures must agree
across the revisions given, and the manifest records each revision's commit.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from source_signatures import as_text, callable_args, find_definition, parameters_with_defaults  # noqa: E402

MANIFEST = Path(__file__).with_name("msamp_signatures.json")
# what lowbit-msamp and its stand-in use, as module and exported name
NAMES = [
    ("msamp", "initialize"),
    ("msamp", "clip_grad_norm_"),
    ("msamp.optim", "LBAdamW"),
    ("msamp.optim", "LBAdam"),
    ("msamp.deepspeed", "initialize"),
    ("msamp.common.tensor", "ScalingTensor"),
    ("msamp.common.tensor", "ScalingMeta"),
]
# `import msamp` runs these top-level imports of other distributions (msamp/__init__ and msamp/te)
IMPORT_FILES = ("msamp/__init__.py", "msamp/te/extension.py")
# `import msamp.deepspeed` imports this file, which takes names from deepspeed's engine module
DEEPSPEED_ENGINE_FILE = "msamp/deepspeed/runtime/engine.py"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def read_revision(repo: Path, revision: str) -> dict:
    commit = _git(repo, "rev-parse", f"{revision}^{{commit}}").strip()
    with tempfile.TemporaryDirectory() as tmp:
        files = [
            f for f in _git(repo, "ls-tree", "-r", "--name-only", commit, "msamp").splitlines() if f.endswith(".py")
        ]
        for name in files + ["pyproject.toml"]:
            target = Path(tmp) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_git(repo, "show", f"{commit}:{name}"))
        root = Path(tmp) / "msamp"
        signatures = {}
        for module, name in NAMES:
            node = find_definition(root, module, name)
            assert node is not None, f"{module}.{name} not found at {revision}"
            signatures[f"{module}.{name}"] = as_text(parameters_with_defaults(callable_args(node)))
        imports = set()
        for file in IMPORT_FILES:
            for node in ast.parse((Path(tmp) / file).read_text()).body:
                if isinstance(node, ast.Import):
                    imports.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    imports.add(node.module)
        engine_imports = [
            alias.name
            for node in ast.parse((Path(tmp) / DEEPSPEED_ENGINE_FILE).read_text()).body
            if isinstance(node, ast.ImportFrom) and node.module == "deepspeed.runtime.engine"
            for alias in node.names
        ]
        dependencies = tomllib.loads((Path(tmp) / "pyproject.toml").read_text())["project"]["dependencies"]
        version = next(
            line.split("=")[1].strip().strip("'\"")
            for line in (root / "__init__.py").read_text().splitlines()
            if line.startswith("__version__")
        )
    return {
        "commit": commit,
        "version": version,
        "signatures": signatures,
        "third_party_imports": sorted(m for m in imports if not m.startswith("msamp")),
        "dependencies": dependencies,
        "deepspeed_engine_imports": engine_imports,
    }


def main(repo: str, *revisions: str) -> None:
    read = {rev: read_revision(Path(repo), rev) for rev in revisions}
    first = read[revisions[0]]
    for rev, data in read.items():
        for key in ("signatures", "deepspeed_engine_imports"):
            assert data[key] == first[key], f"{key} differ between {revisions[0]} and {rev}"
    manifest = {
        "upstream": "https://github.com/Azure/MS-AMP",
        "read_with": "python tests/plugins/msamp/read_msamp_signatures.py <MS-AMP clone> " + " ".join(revisions),
        "revisions": {rev: {"commit": d["commit"], "version": d["version"]} for rev, d in read.items()},
        "signatures": first["signatures"],
        "third_party_imports": first["third_party_imports"],
        "dependencies": first["dependencies"],
        # what `import msamp.deepspeed` takes from deepspeed.runtime.engine (msamp/deepspeed/runtime/engine.py)
        "deepspeed_engine_imports": first["deepspeed_engine_imports"],
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {MANIFEST}")


if __name__ == "__main__":
    main(*sys.argv[1:])
