"""Read a library's signatures from its source text with ``ast``, importing nothing.

For libraries that cannot be imported here (Transformer Engine and MS-AMP need CUDA): the test
stand-ins and lowbit's own calls are checked against what these functions read.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path


def _module_file(root: Path, module: str) -> Path:
    path = root.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def find_definition(root: Path, module: str, name: str, _depth: int = 0) -> ast.AST | None:
    """The ``def``/``class`` that ``module.name`` refers to, following re-exports."""
    if _depth > 8:
        return None
    file = _module_file(root, module)
    if not file.exists():
        return None
    tree = ast.parse(file.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            found = find_definition(root, target, original, _depth + 1)
            if found is None and node.level == 0:  # `from pkg import submodule`-style: try pkg.name
                found = find_definition(root, f"{target}.{original}", original, _depth + 1)
            if found is not None:
                return found
    return None


def callable_args(node: ast.AST) -> ast.arguments:
    """The arguments a call passes into: a function's, or a class's ``__init__`` (``self`` dropped)."""
    if isinstance(node, ast.FunctionDef):
        return node.args
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    assert init is not None, f"class {node.name} has no __init__ of its own"
    args = init.args
    return ast.arguments(
        posonlyargs=args.posonlyargs,
        args=args.args[1:],
        vararg=args.vararg,
        kwonlyargs=args.kwonlyargs,
        kw_defaults=args.kw_defaults,
        kwarg=args.kwarg,
        defaults=args.defaults,
    )


def signature(args: ast.arguments) -> inspect.Signature:
    """An ``inspect.Signature`` with the real parameter names, kinds and presence of defaults."""
    P = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    has_default = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    params = [
        P(
            a.arg,
            P.POSITIONAL_ONLY if a in args.posonlyargs else P.POSITIONAL_OR_KEYWORD,
            default=None if d else P.empty,
        )
        for a, d in zip(positional, has_default)
    ]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [
        P(a.arg, P.KEYWORD_ONLY, default=None if d is not None else P.empty)
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def parameters_with_defaults(args: ast.arguments) -> list[tuple[str, str | None]]:
    """(name, default as source text or None) per parameter, in order, with ``*name`` /
    ``**name`` for catch-alls and a bare ``*`` before keyword-only parameters (as Python writes it)."""
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    params = [(a.arg, d) for a, d in zip(positional, defaults)]
    if args.vararg:
        params.append(("*" + args.vararg.arg, None))
    elif args.kwonlyargs:
        params.append(("*", None))
    params += [(a.arg, ast.unparse(d) if d is not None else None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(("**" + args.kwarg.arg, None))
    return params


def parameters_of(obj) -> list[tuple[str, str | None]]:
    """The same list for a live function or class (a stand-in), defaults as their ``repr``."""
    out: list[tuple[str, str | None]] = []
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not any(name.startswith("*") for name, _ in out):
            out.append(("*", None))
        if p.kind is p.VAR_POSITIONAL:
            out.append(("*" + p.name, None))
        elif p.kind is p.VAR_KEYWORD:
            out.append(("**" + p.name, None))
        else:
            out.append((p.name, None if p.default is p.empty else repr(p.default)))
    return out


def as_text(params: list[tuple[str, str | None]]) -> str:
    """``model, optimizer=None, *, flag=False``: one line, for a manifest and for messages."""
    return ", ".join(name if default is None else f"{name}={default}" for name, default in params)
