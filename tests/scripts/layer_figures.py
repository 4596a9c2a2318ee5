"""Write the figures docs/architecture.md quotes about the core's layers, measured on this checkout:
lines of code per layer, the import statements read (and how many cross a layer), and what the
Accelerate front does itself (its lines, its __init__'s body, the runtime modules it imports). The
paragraph between the page's ``layer figures`` markers is this script's; ``--print`` only prints it.

    python tests/scripts/layer_figures.py [--print]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_layers import LAYERS, ROOT, core_modules, imported_modules, layer_of  # noqa: E402

PAGE = ROOT / "docs" / "architecture.md"
MARKERS = ("<!-- layer figures: written by tests/scripts/layer_figures.py -->", "<!-- /layer figures -->")


def paragraph() -> str:
    lines = dict.fromkeys(LAYERS, 0)
    statements = crossing = 0
    for name, path in core_modules().items():
        lines[layer_of(name)] += len(path.read_text().splitlines())
        for module, _line in imported_modules(path, name):
            statements += 1
            crossing += layer_of(module) != layer_of(name)
    front = core_modules()["lowbit.compat.accelerator"]
    tree = ast.parse(front.read_text())
    init = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    runtime = {m for m, _ in imported_modules(front, "lowbit.compat.accelerator") if layer_of(m) == "runtime"}
    per_layer = ", ".join(f"{layer} {count:,}" for layer, count in lines.items())
    return (
        f"On this checkout (formatted by `ruff format`), lines per layer: {per_layer}\n"
        "(transformers' room, `integrations/transformers/`, is part of the top layer);\n"
        f"{statements:,} lowbit imports read, {crossing:,} of them crossing a layer, none upward.\n"
        f"`compat/accelerator.py` is {len(front.read_text().splitlines()):,} lines, its `Accelerator.__init__` a "
        f"{init.end_lineno - init.body[0].lineno + 1}-line body; it imports {len(runtime)} runtime modules "
        "and none of the checkpoint or FP8-report\nmodules (`tests/core/compat/test_facade.py`)."
    )


def main() -> None:
    text = paragraph()
    if "--print" in sys.argv[1:]:
        print(text)
        return
    page = PAGE.read_text()
    pattern = re.compile(re.escape(MARKERS[0]) + r"\n.*?\n" + re.escape(MARKERS[1]), re.S)
    if not pattern.search(page):
        raise SystemExit(f"{PAGE} has no paragraph between {MARKERS[0]!r} and {MARKERS[1]!r}")
    PAGE.write_text(pattern.sub(lambda _: f"{MARKERS[0]}\n{text}\n{MARKERS[1]}", page))
    print(f"wrote the layer figures into {PAGE}")


if __name__ == "__main__":
    main()
