"""Shared pytest set-up: Hypothesis profiles and the GPU skip.

- Hypothesis: profile "ci" (no deadline, a modest number of examples, derandomized, for 2-core CI
  machines) is loaded by default; ``HYPOTHESIS_PROFILE=dev`` (200 random examples) or ``=quick`` (5)
  picks another.
- GPU: a test marked ``@pytest.mark.gpu`` or using the ``requires_gpu`` fixture is skipped, with the
  reason, unless CuPy imports and sees a CUDA device. The ``requires_gpu`` fixture returns the cupy
  module.
"""

import functools
import os

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is in the "test" extra; tests that need it import it themselves
    settings = None

if settings is not None:
    _slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
    # "ci" is derandomized: a CI run tests the same examples every time, so it cannot fail by luck.
    settings.register_profile(
        "ci", deadline=None, max_examples=30, derandomize=True, suppress_health_check=_slow_ok
    )
    settings.register_profile("dev", deadline=None, max_examples=200, suppress_health_check=_slow_ok)
    settings.register_profile("quick", deadline=None, max_examples=5, suppress_health_check=_slow_ok)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when CuPy imports and sees a CUDA device, else why not (checked once per session)."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    except Exception as exc:  # a broken install: skip, but say why
        return f"CuPy failed to import: {exc}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:
        return f"no usable CUDA device: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and gpu_skip_reason() is not None:
        skip = pytest.mark.skip(reason=f"needs a CUDA GPU and CuPy: {gpu_skip_reason()}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def requires_gpu():
    """Skip the test unless CuPy and a CUDA device are present; returns the cupy module."""
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(f"needs a CUDA GPU and CuPy: {reason}")
    import cupy

    return cupy


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if validation lets a call reach a backend."""
    from cuflash._ops import api as _api

    def refuse(library):
        raise AssertionError(f"validation should have failed before the {library} backend was chosen")

    monkeypatch.setattr(_api, "_backend", refuse)
