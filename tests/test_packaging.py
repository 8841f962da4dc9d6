"""Release readiness: ``python -m build`` makes an sdist and a wheel (the wheel built from the sdist, as
``build`` does by default) that carry the license and every kernel source, and a fresh install of the
wheel, in a new virtual environment and run from another directory with no checkout in sight, runs the
CPU demo and finds every ``.cu``/``.cuh`` file of ``cuflash_kernels/`` as package data.

The fresh environment gets the wheel and its runtime dependencies (its ``Requires-Dist`` without an extra:
NumPy, ml_dtypes, ...) at the versions already installed here, so pip takes them from its cache or the
configured index; torch, JAX and the other test extras are never installed into it. The build runs without
isolation (``build`` and ``setuptools`` come with the ``dev`` extra), on a copy of the source tree so the
checkout gets no ``build/`` or ``*.egg-info``. About 15 s on a 2-core machine with a warm pip cache."""

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.name for p in (ROOT / "cuflash_kernels").iterdir() if p.suffix in (".cu", ".cuh"))

# Left out of the copy that is built: environments, caches, earlier builds and anything git ignores.
_IGNORE = shutil.ignore_patterns(".git", ".venv", ".old", "build", "dist", "*.egg-info", "__pycache__",
                                 ".hypothesis", ".pytest_cache", ".asv", ".whl", ".device", "site")


def _source_version() -> str:
    """``__version__`` as written in cuflash/__init__.py, the one place the version lives."""
    tree = ast.parse((ROOT / "cuflash" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("cuflash/__init__.py assigns no __version__")


def test_version_has_one_source():
    """pyproject.toml reads the version from the package instead of repeating it."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert 'version = { attr = "cuflash.__version__" }' in text
    assert f'version = "{_source_version()}"' not in text
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert 'license = "BSD-3-Clause"' in text


def _runtime_dependencies(wheel) -> list[str]:
    """Names of the wheel's requirements that no extra guards (what ``pip install cuflash`` brings)."""
    with zipfile.ZipFile(wheel) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    requires = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    names = [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires if "extra ==" not in r]
    assert "numpy" in names, requires
    return names


def _run(args, **kwargs):
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    pytest.importorskip("build")
    pytest.importorskip("setuptools")
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_IGNORE)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", source])
    version = _source_version()
    sdist = work / "dist" / f"cuflash-{version}.tar.gz"
    wheel = work / "dist" / f"cuflash-{version}-py3-none-any.whl"
    assert sdist.exists() and wheel.exists(), sorted(os.listdir(work / "dist"))
    return work, sdist, wheel


def test_sdist_and_wheel_carry_license_and_kernels(dists):
    _, sdist, wheel = dists
    prefix = sdist.name[: -len(".tar.gz")]
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    for name in ["LICENSE", "README.md", "pyproject.toml"] + [f"cuflash_kernels/{k}" for k in KERNELS]:
        assert f"{prefix}/{name}" in names, f"{name} missing from the sdist"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = whl.read(f"{prefix}.dist-info/METADATA").decode()
    for kernel in KERNELS:
        assert f"cuflash_kernels/{kernel}" in names, f"{kernel} missing from the wheel"
    assert f"{prefix}.dist-info/licenses/LICENSE" in names
    assert f"Version: {_source_version()}\n" in metadata
    assert "License-Expression: BSD-3-Clause" in metadata


def test_fresh_install_runs_demo_and_finds_kernels(dists):
    work, _, wheel = dists
    env_dir = work / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # the pip running these tests installs into it
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    pins = [f"{name}=={md.version(name)}" for name in _runtime_dependencies(wheel)]
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
          "--disable-pip-version-check", wheel, *pins])

    elsewhere = work / "elsewhere"  # no checkout on the path: the installed copy is the one imported
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    demo = _run([python, "-m", "cuflash", "demo"], cwd=elsewhere, env=env)
    assert "backend numpy" in demo.stdout and demo.stdout.rstrip().endswith("PASS"), demo.stdout

    probe = """
import importlib.metadata as md, importlib.resources as res, json, cuflash
names = sorted(p.name for p in res.files("cuflash_kernels").iterdir() if p.name.endswith((".cu", ".cuh")))
sizes = {n: len(res.files("cuflash_kernels").joinpath(n).read_bytes()) for n in names}
dists = sorted(d.metadata["Name"].lower() for d in md.distributions())
print(json.dumps({"file": cuflash.__file__, "version": cuflash.__version__, "dist": md.version("cuflash"),
                  "kernels": names, "sizes": sizes, "dists": dists}))
"""
    found = json.loads(_run([python, "-c", probe], cwd=elsewhere, env=env).stdout)
    assert Path(found["file"]).resolve().is_relative_to(env_dir.resolve()), found["file"]
    assert found["version"] == found["dist"] == _source_version()
    assert found["kernels"] == KERNELS
    assert found["sizes"] == {k: (ROOT / "cuflash_kernels" / k).stat().st_size for k in KERNELS}
    assert "torch" not in found["dists"] and "jax" not in found["dists"], found["dists"]
