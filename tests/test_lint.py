"""The package, tests, benchmarks and examples have no undefined or unused names (ruff's pyflakes rules).

tools/ (the device check scripts) is left out: they free GPU memory with ``del`` at the end of loops whose
closures pyflakes then reports as undefined, although they run correctly.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_no_errors():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the dev extra)")
    result = subprocess.run([ruff, "check", "cuflash", "tests", "asv_bench", "examples"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
