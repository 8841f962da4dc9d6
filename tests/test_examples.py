"""The examples run and do what they claim."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN_TINY = ROOT / "examples" / "train_tiny.py"


def load_example(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tiny_script_runs_and_the_loss_halves():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(TRAIN_TINY), "--steps", "40"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step   0  loss" in result.stdout and "chance level" in result.stdout


@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "naive"])
def test_train_tiny_learns_with_every_algorithm(algorithm):
    train_tiny = load_example(TRAIN_TINY)
    losses = train_tiny.train(steps=30, algorithm=algorithm, seed=1, verbose=False)
    assert len(losses) == 30
    assert losses[-1] < 0.5 * losses[0], losses
