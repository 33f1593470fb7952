"""Fixtures shared by the tests."""

import os
from pathlib import Path

import pytest

from support import smollm2_path


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Tests never read or fill the user's kernel cache."""
    os.environ["HIPC_CACHE_DIR"] = str(tmp_path_factory.mktemp("hipc-cache"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_path()
