"""The Gated DeltaNet kernels (templates/hip/deltanet.hip.j2, the token-serial one;
deltanet_chunk.hip.j2, the chunked prefill) alone on a real GPU, against NumPy.

Run with `pytest -m gpu` on the GPU machine (skipped where no GPU is found). Each case renders
the kernels as compiler/kernels/deltanet.py does and runs a sequence of steps on one pair of
states (prefill steps of several tokens and decode steps of one, so the conv window and the
delta-rule matrices carry from step to step), checked by tests/deltanet_cases.py (every
output row NaN-poisoned first, the chunked kernels' scratch too, both states, against NumPy's
recurrence in float64; the host test tests/compiler/test_gpu_deltanet_host.py runs the same
cases without a GPU). Cases: grouped and tiled value heads, odd head counts, the three conv
weight types, Qwen3-Next's projections packed per key head, and the Qwen3.5-35B shape (16 key
/ 32 value heads of 128) with one lane per state column (the default) and with two, and dk
256 with the default two lanes and with four. The chunked prefill runs steps shorter than
(serial), equal to and several times its chunk, and the two forms are compared with each
other on one long step from the same random states; the chunked kernels as compiled for the
device (sm_90: _solve's and _scan's products on mma.sync, 32 state columns a scan block), all
SIMT (the path of targets without a matrix instruction), and _solve on the matrix instruction
with the SIMT _scan (AMD's default).
"""

from __future__ import annotations

import pytest
from deltanet_cases import (
    CASES,
    CHUNKED,
    check_batch,
    check_forms,
    check_steps,
    device_specs,
)

from gpu_kernels import DeviceKernels

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    built = {}

    def build(arch):
        specs, built["serial"], built["paths"] = device_specs(arch)
        return specs

    dev = DeviceKernels(build)
    dev.specs, dev.paths = built["serial"], built["paths"]
    yield dev
    dev.close()


def on(kernels, path: str, name: str):
    """Case `name`'s chunked kernels on `path`: "target" (as compiled), "simt" (the path of
    targets without a matrix instruction), "mma_solve" (_solve on it, _scan SIMT), "mma_scan"
    (_scan on it too)."""
    if name not in kernels.paths[path]:
        pytest.skip(f"no {path} chunked kernels for {name} on this target")
    return kernels.paths[path][name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_deltanet_steps_match_numpy(kernels, name):
    check_steps(kernels, name)


@pytest.mark.parametrize("name", ["grouped_odd", "next_packed_f16", "qwen35_35b", "dk256"])
def test_rows_of_several_sequences_in_their_slots(kernels, name):
    """A step's runs of several sequences (and padding rows) each in its own slot."""
    check_batch(kernels, name)


@pytest.mark.parametrize("name", ["grouped_odd", "qwen35_35b"])
def test_one_sequence_in_another_slot(kernels, name):
    """Slot 2 of the pools: the serial and chunked kernels touch that slot only."""
    check_steps(kernels, name, on(kernels, "target", name), slot=2)


@pytest.mark.parametrize("path", ["target", "simt", "mma_solve", "mma_scan"])
@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_chunked_prefill_steps_match_numpy(kernels, name, path):
    check_steps(kernels, name, on(kernels, path, name))


@pytest.mark.parametrize(
    ("name", "T"),
    [("qwen35_35b", 64), ("qwen35_35b", 300), ("tiled_bf16", 200), ("next_packed_f16", 50)],
)
def test_chunked_and_serial_kernels_agree(kernels, name, T):
    check_forms(kernels, name, T, on(kernels, "target", name))


@pytest.mark.parametrize("path", ["simt", "mma_solve", "mma_scan"])
def test_other_chunked_paths_and_serial_kernels_agree(kernels, path):
    check_forms(kernels, "qwen35_35b", 200, on(kernels, path, "qwen35_35b"))
