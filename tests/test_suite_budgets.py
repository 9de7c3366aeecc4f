"""The suite's time limits agree with the waits inside the tests: no test is killed by
pytest-timeout first.

Every `timeout=N` (a literal number of seconds) given to a call inside a test function is a wait
the test itself allows; pytest-timeout's limit for that test (its own mark, else its module's
`pytestmark`, else pyproject's `timeout`) must cover their sum, or on a loaded machine the suite
kills a test that would have passed and reports the kill, not the test's own message.
"""

from __future__ import annotations

import ast
import tomllib

from tests.paths import REPO

ROOT = REPO


def _timeout_mark(decorators: list[ast.expr]) -> float | None:
    for d in decorators:
        for node in ast.walk(d):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "timeout"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, (int, float))
            ):
                return float(node.args[0].value)
    return None


def _module_mark(tree: ast.Module) -> float | None:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            value = (
                stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
            )
            return _timeout_mark(list(value))
    return None


def _waits(fn: ast.AST) -> float:
    total = 0.0
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if (
                    kw.arg == "timeout"
                    and isinstance(kw.value, ast.Constant)
                    and isinstance(kw.value.value, (int, float))
                ):
                    total += float(kw.value.value)
    return total


def budgets() -> list[tuple[str, float, float]]:
    """(test, seconds its own waits allow, seconds pytest-timeout gives it) for every test with a
    literal wait."""
    default = float(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "timeout"
        ]
    )
    out = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = _module_mark(tree)
        for fn in tree.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith(
                "test_"
            ):
                waits = _waits(fn)
                if waits:
                    limit = _timeout_mark(fn.decorator_list) or module or default
                    out.append((f"{path.name}::{fn.name}", waits, limit))
    return out


def test_each_tests_limit_covers_the_waits_it_allows_itself() -> None:
    found = budgets()
    # the scan sees the real-model tests
    assert any(name.startswith("test_evaluate.py::") for name, _, _ in found)
    short = [
        f"{name}: waits up to {w:g} s, killed at {lim:g} s" for name, w, lim in found if w > lim
    ]
    assert not short, "give these tests a pytest.mark.timeout above their waits:\n" + "\n".join(
        short
    )
