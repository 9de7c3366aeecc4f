"""README's Python examples: each one compiles, imports only names that exist, and the offline ones run as written.

Examples that need a judge server or a broker (OpenAIJudge at localhost, a harness loop) are run
end to end elsewhere (test_hook_offline, test_client, test_serve_cli); here their imports are checked.
Examples that use FakeJudge need nothing and are executed exactly as printed.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_example_compiles_and_imports_exist(block: str) -> None:
    tree = ast.parse(block)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agent_monitor"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"README imports {alias.name} from {node.module}: no such name"


@pytest.mark.parametrize("block", [b for b in BLOCKS if "FakeJudge" in b], ids=lambda b: b.split("\n", 1)[0][:40])
def test_offline_examples_run_as_written(block: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
