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


GENERATE = ROOT / "examples" / "generate.py"


def test_generate_script_runs_and_prints_tokens_per_second():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(GENERATE), "--tokens", "6"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens/s" in result.stdout and "max |logits - recomputed|" in result.stdout


@pytest.mark.parametrize("page_size, dtype", [(1, "float64"), (3, "float64"), (16, "float32")])
def test_generate_decodes_with_a_paged_cache_equal_to_recomputation(page_size, dtype):
    generate = load_example(GENERATE)
    stats = generate.generate(tokens=8, batch=3, page_size=page_size, dtype=dtype, seed=2, verbose=False)
    assert stats["max_error"] <= (1e-12 if dtype == "float64" else 1e-5)
    prompt_lengths = [len(s) - 8 for s in stats["sequences"]]
    assert all(length >= generate.SYSTEM_PROMPT + 1 for length in prompt_lengths)
    table = stats["block_table"]
    shared = generate.SYSTEM_PROMPT // page_size
    # the system prompt's full pages are shared; every other page belongs to one sequence
    assert (table[:, :shared] == table[0, :shared]).all()
    own = table[:, shared:][table[:, shared:] >= 0]
    assert len(set(own.tolist())) == own.size and not set(own.tolist()) & set(table[0, :shared].tolist())


@pytest.mark.gpu
def test_generate_on_the_gpu_decodes_equal_to_recomputation(requires_gpu):
    """The same decoder on CuPy arrays: the CUDA decode kernels (paged, shared pages, batched steps) against the
    forward kernels recomputing every sequence, in float16."""
    generate = load_example(GENERATE)
    stats = generate.generate(tokens=8, batch=3, page_size=5, dtype="float16", seed=3, verbose=False, device="gpu")
    assert stats["max_error"] <= 3e-2 and stats["tokens_per_s"] > 0

