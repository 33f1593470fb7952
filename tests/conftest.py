"""Fixtures shared by the tests."""

import os
from pathlib import Path

import pytest

from support import require, smollm2_path


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Tests never read or fill the user's kernel cache."""
    os.environ["HIPC_CACHE_DIR"] = str(tmp_path_factory.mktemp("hipc-cache"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_gguf):
    """transformers' tokenizer and float32 model for the SmolLM2 GGUF, loaded once."""
    transformers = require("transformers")
    require("torch")
    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype="float32"
    )
    return tok, model.eval()


_gpu_probe: tuple[bool, str] | None = None


def _gpu_found() -> tuple[bool, str]:
    """(found, why not): an NVIDIA GPU through cuda-bindings, or an AMD GPU through hip-python."""
    global _gpu_probe
    if _gpu_probe is None:
        from hipc.runtime.backends import cuda, hip

        nvidia, why_nvidia = cuda.probe()
        amd, why_amd = (None, "") if nvidia else hip.probe()
        _gpu_probe = (True, "") if nvidia or amd else (False, f"{why_nvidia}; {why_amd}")
    return _gpu_probe


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where no GPU is found, with the reason."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    found, why = _gpu_found()
    if not found:
        skip = pytest.mark.skip(reason=f"needs a GPU: {why}")
        for item in marked:
            item.add_marker(skip)
