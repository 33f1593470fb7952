"""Fixtures shared by the tests."""

from pathlib import Path

import pytest

from support import smollm2_path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_path()
