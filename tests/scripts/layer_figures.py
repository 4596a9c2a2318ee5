"""Print the figures docs/architecture.md quotes about the core's layers, measured on this checkout:
lines of code per layer, the import statements read (and how many cross a layer), and what the
Accelerate front does itself (its __init__'s body, the runtime modules it imports).

    python tests/scripts/layer_figures.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_layers import LAYERS, core_modules, imported_modules, layer_of  # noqa: E402


def main() -> None:
    lines = dict.fromkeys(LAYERS, 0)
    statements = crossing = 0
    for name, path in core_modules().items():
        lines[layer_of(name)] += len(path.read_text().splitlines())
        for module, _line in imported_modules(path, name):
            statements += 1
            crossing += layer_of(module) != layer_of(name)
    print("lines per layer: " + ", ".join(f"{layer} {count}" for layer, count in lines.items()))
    print(f"lowbit imports read: {statements}, crossing a layer: {crossing}")
    front = core_modules()["lowbit.compat.accelerator"]
    tree = ast.parse(front.read_text())
    init = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    print(
        f"compat/accelerator.py: {len(front.read_text().splitlines())} lines; Accelerator.__init__ body "
        f"{init.end_lineno - init.body[0].lineno + 1} lines; runtime modules it imports: "
        f"{len({m for m, _ in imported_modules(front, 'lowbit.compat.accelerator') if layer_of(m) == 'runtime'})}"
    )


if __name__ == "__main__":
    main()
