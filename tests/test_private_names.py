"""Every touch of torch's and Triton's private names lives in ``coordinator._compat``:
nothing else in the package imports a private module or name of either (a dotted part with
a leading underscore), or calls Triton's private ``_make_path``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "coordinator"
LIBRARIES = ("torch", "triton")


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _touches(node: ast.AST) -> list[str]:
    """The private names of torch or Triton that ``node`` imports or reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] in LIBRARIES and _private(alias.name)]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
        names = [alias.name for alias in node.names]
        return [f"from {node.module} import {', '.join(names)}"] if _private(node.module) or any(
            _private(name) for name in names) else []
    if isinstance(node, ast.Attribute) and node.attr == "_make_path":
        return [f".{node.attr}"]
    return []


def test_nothing_outside_compat_imports_a_private_torch_or_triton_name():
    sources = [path for path in PACKAGE.rglob("*.py") if "_compat" not in path.relative_to(PACKAGE).parts]
    assert len(sources) > 40
    leaks = [f"{path.relative_to(PACKAGE.parent)}: {touch}" for path in sources
             for node in ast.walk(ast.parse(path.read_text(), str(path))) for touch in _touches(node)]
    assert leaks == []


@pytest.mark.parametrize("source, private", [
    ("from torch._inductor import config", True),
    ("import torch._dynamo", True),
    ("from torch.distributed import _functional_collectives", True),
    ("manager._make_path(name)", True),
    ("import torch.distributed as dist", False),
    ("from triton.runtime import build", False),
])
def test_the_check_sees_a_private_name(source, private):
    assert bool([touch for node in ast.walk(ast.parse(source)) for touch in _touches(node)]) == private
