"""The package's shape, checked from its source: no function grows past a screen (about 80 lines) unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest_vllm_mem

PACKAGE = Path(pytest_vllm_mem.__file__).parent
LIMIT = 80  # lines, decorators and docstring included: what a reviewer reads in one screen


def function_lengths() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                name = f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"
                lengths[name] = max(lengths.get(name, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_is_longer_than_a_screen() -> None:
    lengths = function_lengths()
    too_long = {name: lines for name, lines in lengths.items() if lines > LIMIT}
    assert too_long == {}, f"split these functions (over {LIMIT} lines): {too_long}"
