"""The documentation site builds without warnings and the asv suite stays loadable (CI has no GPU: the
GPU benchmarks must skip themselves cleanly there)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|exc|data|obj|const|type|ref|doc):(?:<code>|`)")


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()
    # Sphinx roles in docstrings (":func:`attention`") render as plain code, not as ":func:" text.
    for page in (tmp_path / "site").rglob("*.html"):
        raw = SPHINX_ROLE.findall(page.read_text(encoding="utf-8"))
        assert not raw, f"{page.relative_to(tmp_path)} shows Sphinx roles: {raw[:5]}"


def test_markdown_pages_use_no_sphinx_roles():
    """The pages are read as Markdown on the code host too, where a role would show as raw text."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        raw = SPHINX_ROLE.findall(page.read_text(encoding="utf-8"))
        assert not raw, f"{page.name} uses Sphinx roles: {raw[:5]}"


def test_asv_suite_check(tmp_path):
    asv = shutil.which("asv", path=os.path.dirname(sys.executable)) or shutil.which("asv")
    if asv is None:
        pytest.skip("asv is not installed (the bench extra)")
    env = {**os.environ, "HOME": str(tmp_path)}  # asv keeps its machine file in $HOME
    subprocess.run([asv, "machine", "--yes"], cwd=ROOT / "asv_bench", env=env, check=True, capture_output=True)
    result = subprocess.run(
        [asv, "check", "--python=same"], cwd=ROOT / "asv_bench", env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Error" not in result.stdout + result.stderr, result.stdout + result.stderr
