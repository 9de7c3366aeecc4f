"""The manual's Python examples (README.md and every page in docs/) and the site's shape.

Each example compiles and imports only names that exist, and the offline ones run as written.
Examples that need a judge server or a broker (OpenAIJudge at localhost, a harness loop) are run end
to end elsewhere (test_hook_offline, test_client, test_serve_cli); here their imports are checked.
Examples that use FakeJudge need nothing and are executed exactly as printed. README stays a first
screen (under 200 lines), and every page in docs/ is in mkdocs.yml's nav (`mkdocs build --strict`,
in `make check`, fails on broken links and anchors).
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of one Markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


BLOCKS = [
    (p.relative_to(REPO).as_posix(), i, b) for p in PAGES for i, b in enumerate(python_blocks(p))
]
IDS = [f"{name}:block{i}" for name, i, _ in BLOCKS]


def test_the_examples_are_where_the_manual_puts_them() -> None:
    # The regex finding nothing would pass every test below: name the pages whose examples must be
    # found.
    found = {name for name, _, _ in BLOCKS}
    runnable = {name for name, _, b in BLOCKS if "FakeJudge" in b}
    assert {
        "README.md",
        "docs/hook.md",
        "docs/daemon.md",
        "docs/opentelemetry.md",
        "docs/criteria.md",
    } <= found
    assert {"docs/hook.md", "docs/daemon.md", "docs/best-of-n.md", "docs/metrics.md"} <= runnable
    assert len(BLOCKS) >= 12


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS, ids=IDS)
def test_example_compiles_and_imports_exist(page: str, index: int, block: str) -> None:
    tree = ast.parse(block)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("agent_monitor")
        ):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), (
                    f"{page} imports {alias.name} from {node.module}: no such name"
                )


RUNNABLE = [(page, i, b) for page, i, b in BLOCKS if "FakeJudge" in b]


@pytest.mark.parametrize(
    ("page", "index", "block"), RUNNABLE, ids=[f"{p}:block{i}" for p, i, _ in RUNNABLE]
)
def test_offline_examples_run_as_written(page: str, index: int, block: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, f"{page} block {index}:\n{done.stderr}"


def test_readme_is_a_first_screen_under_200_lines() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 200, (
        f"README.md has {len(lines)} lines: move the section to a page in docs/ and link it"
    )


def nav_files(nav: object) -> list[str]:
    """Every page file named in an MkDocs nav (a list of pages, `title: page` and `title:
    [sections]`)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in nav_files(value)]
    raise AssertionError(f"mkdocs.yml nav has an entry that is not a page or a section: {nav!r}")


def test_every_docs_page_is_in_the_nav_once() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    listed = nav_files(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(listed)) == pages, (
        f"not in mkdocs.yml's nav: {sorted(set(pages) - set(listed))}; no such page: "
        f"{sorted(set(listed) - set(pages))}"
    )
    assert len(listed) == len(set(listed)), "a page is in the nav twice"


def test_readmes_relative_links_name_files_that_exist() -> None:
    # mkdocs checks links between pages in docs/; README sits outside it, so its links are checked
    # here.
    text = (REPO / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        path = target.split("#", 1)[0]
        assert path and (REPO / path).exists(), f"README.md links to {target}: no such file"
