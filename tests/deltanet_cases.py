"""Gated DeltaNet kernel cases and their NumPy check, shared by the GPU test
(tests/gpu/test_deltanet_gpu.py, on a device) and the host test
(tests/compiler/test_gpu_deltanet_host.py, the same template run as host threads).

`check_steps(kernels, name)` runs case `name` as a sequence of steps on one pair of states
through `kernels` (tests/gpu_kernels.DeviceKernels' upload/poisoned/launch/read/free) and
compares every output row (NaN-poisoned first) and both states after each step with NumPy
in float64: the causal conv, L2 norms and the delta rule's recurrence from compiler/reference
(delta_rule.recurrent, expand_heads), the gates and the gated RMSNorm written out here.
`check_steps(kernels, name, chunks)` runs CHUNKED's steps instead, those of a chunk or more
through the chunked prefill's four kernels (`chunks`: (kernels, params); their scratch
NaN-poisoned too), the others through the token-serial kernel, on the same states;
`check_forms` runs one long step both ways from the same random states and compares the two
kernels' outputs with each other.
"""

from __future__ import annotations

import numpy as np

from hipc.base.launch_plan import eval_dim
from hipc.compiler.kernels.base import GpuKernel
from hipc.compiler.kernels.deltanet import (
    DeltaNetParams,
    chunk_launches,
    chunk_mma,
    chunk_work_bytes,
    gpu_chunk_kernel,
    gpu_kernel,
    scan_mma_fits,
)
from hipc.compiler.reference import delta_rule
from hipc.compiler.targets import GpuTarget

from gpu_kernels import pack
from support import rel_err

# name: (NK, NV, DK, DV, KC, v_tiled, dt_bias, packed (Qwen3-Next), conv weight type, steps)
CASES = {
    "grouped_odd": (3, 9, 16, 24, 4, False, True, False, "float32", (20, 1, 1, 7, 1)),
    "tiled_bf16": (2, 6, 32, 16, 4, True, False, False, "bfloat16", (1, 5, 1, 64)),
    "next_packed_f16": (3, 6, 8, 12, 3, False, True, True, "float16", (9, 1, 1, 33)),
    "one_tap": (1, 1, 8, 8, 2, False, True, False, "float32", (3, 1)),
    "qwen35_35b": (16, 32, 128, 128, 4, False, True, False, "bfloat16", (6, 1, 1)),  # 1 lane
    "qwen35_35b_two_lanes": (16, 32, 128, 128, 4, False, True, False, "bfloat16", (6, 1, 1)),
    "grouped_two_lanes": (2, 4, 32, 16, 4, False, True, False, "float32", (7, 1, 1)),
    "dk256": (1, 2, 256, 40, 4, False, True, False, "float32", (5, 1)),  # 2 lanes by default
    "dk256_four_lanes": (1, 2, 256, 40, 4, False, True, False, "float32", (5, 1)),
}
# lanes per state column where a case asks for other than compiler/kernels/deltanet.py's
# default (gpu_lanes): the splits the compiled default does not take stay tested
LANES = {"qwen35_35b_two_lanes": 2, "grouped_two_lanes": 2, "dk256_four_lanes": 4}
# the chunked prefill: name -> (chunk, steps): steps shorter than, equal to and several
# times the chunk (and a partial last chunk), decode steps between them
CHUNKED = {
    "grouped_odd": (16, (20, 1, 48, 7, 1, 16)),
    "tiled_bf16": (64, (1, 64, 1, 150, 3)),
    "next_packed_f16": (16, (33, 1, 16, 3)),
    "one_tap": (16, (40, 2)),
    "dk256": (32, (40, 1)),
    "qwen35_35b": (64, (150, 1, 64, 1)),
}
SCALE_EPS = dict(l2_eps=1e-6, norm_eps=1e-6)


def params(case, chunk: int = 64) -> DeltaNetParams:
    NK, NV, DK, DV, KC, tiled, dt, packed, wtype, _ = case
    return DeltaNetParams(
        NK=NK, NV=NV, DK=DK, DV=DV, KC=KC, scale=DK**-0.5, v_tiled=tiled, dt_bias=dt,
        ba_packed=packed, qkvz_packed=packed, chunk=chunk, conv_wtype=wtype, **SCALE_EPS,
    )  # fmt: skip


def device_specs(arch: str):
    """Every case's kernels as tests/gpu/test_deltanet_gpu.py builds them for `arch`:
    (DeviceKernels specs, {name: (serial fn, threads)}, {path: {name: (chunked kernels,
    params)}}: "target" as compiled for `arch`; where it has a matrix instruction also
    "simt" (all SIMT) and "mma_scan" (_scan on it too, where the shape fits))."""
    wave, mma = GpuTarget(arch).wave, chunk_mma(arch)
    specs, serial = [], {}
    paths: dict[str, dict] = {"target": {}, "simt": {}, "mma_solve": {}, "mma_scan": {}}
    for name, case in CASES.items():
        k = gpu_kernel(f"dn_{name}", params(case), wave, [name], LANES.get(name))
        serial[name] = (k.fn, k.threads)
        specs.append((k.fn, k.template, k.ctx, 0))
    for name in CHUNKED:
        paths["target"][name] = k, p = chunk_kernels(name, wave, mma)
        specs.append((k.fn, k.template, k.ctx, None))  # four kernels, looked up at launch
        if mma:
            paths["simt"][name] = k, _ = chunk_kernels(name, wave)
            specs.append((k.fn, k.template, k.ctx, None))
            # _solve on it, _scan SIMT: the default where the scan on mma is not (AMD)
            paths["mma_solve"][name] = k, _ = chunk_kernels(name, wave, mma, False)
            specs.append((k.fn, k.template, k.ctx, None))
        if scan_mma_fits(p, mma):
            paths["mma_scan"][name] = k, _ = chunk_kernels(name, wave, mma, True)
            specs.append((k.fn, k.template, k.ctx, None))
    return specs, serial, paths


def chunk_kernels(
    name: str, wave: int, mma: str = "", scan_mma: bool | None = None
) -> tuple[GpuKernel, DeltaNetParams]:
    """Case `name`'s chunked prefill kernels (CHUNKED's chunk) as compiler/kernels/deltanet.py
    renders them, and their parameters; `mma` as chunk_mma says, `scan_mma` _scan on it too
    (each suffixing the name unless None: as compiled, deltanet.scan_on_mma)."""
    p = params(CASES[name], CHUNKED[name][0])
    scan = {None: "", True: "_scan", False: "_simtscan"}[scan_mma]
    fn = f"dnc_{name}" + ("_mma" if mma else "") + scan
    return gpu_chunk_kernel(fn, p, wave, [name], mma, scan_mma=scan_mma), p


def silu(x):
    return x / (1 + np.exp(-x))


class Reference:
    """One sequence in float64: the states, and a step's outputs in the standard layout."""

    def __init__(self, case, w, A, dt_bias, norm_w):
        self.NK, self.NV, self.DK, self.DV, self.KC, self.tiled, *_ = case
        self.C = 2 * self.NK * self.DK + self.NV * self.DV
        self.w, self.A, self.dt, self.norm_w = w, A, dt_bias, norm_w
        self.conv = np.zeros((self.KC - 1, self.C))
        self.S = np.zeros((self.NV, self.DK, self.DV))

    def step(self, x, z, b, a):
        """x [T, C], z [T, NV*DV], b, a [T, NV] -> y [T, NV*DV]."""
        NK, NV, DK, DV, T = self.NK, self.NV, self.DK, self.DV, len(x)
        window = np.concatenate([self.conv, x])
        c = sum(window[j : j + T] * self.w[:, j] for j in range(self.KC))
        self.conv = window[T:]
        c = silu(c)
        keys = NK * DK
        q, k = c[:, :keys].reshape(T, NK, DK), c[:, keys : 2 * keys].reshape(T, NK, DK)
        v = c[:, 2 * keys :].reshape(T, NV, DV)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + SCALE_EPS["l2_eps"])
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + SCALE_EPS["l2_eps"])
        q = delta_rule.expand_heads(q, NV, self.tiled) * DK**-0.5
        k = delta_rule.expand_heads(k, NV, self.tiled)
        beta = 1 / (1 + np.exp(-b))
        g = self.A * np.log1p(np.exp(a + (self.dt if self.dt is not None else 0)))
        o, self.S = delta_rule.recurrent(q, k, v, g, beta, self.S)
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + SCALE_EPS["norm_eps"]) * self.norm_w
        return (o * silu(z.reshape(T, NV, DV))).reshape(T, NV * DV)


def pack_qkvz(x, z, NK, DK, R, DV):
    """Standard [q | k | v] and z rows -> Qwen3-Next's rows packed per key head."""
    T, keys = len(x), NK * DK
    q, k = x[:, :keys].reshape(T, NK, DK), x[:, keys : 2 * keys].reshape(T, NK, DK)
    v = x[:, 2 * keys :].reshape(T, NK, R * DV)
    return np.concatenate([q, k, v, z.reshape(T, NK, R * DV)], -1).reshape(T, -1)


class Layer:
    """One case's weights (random, from the case's seed) and its inputs' layout on a device."""

    def __init__(self, kernels, name: str) -> None:
        case = CASES[name]
        NK, NV, DK, DV, KC, _, dt, packed, wtype, _ = case
        self.kernels, self.case, self.packed = kernels, case, packed
        self.C = 2 * NK * DK + NV * DV
        self.rng = rng = np.random.default_rng(sorted(CASES).index(name) + 40)
        w_stored, self.w = pack(rng.standard_normal((self.C, KC)) * 0.5, wtype)
        self.A = -rng.uniform(0.5, 8, NV)  # -exp(A_log)
        self.dt_bias = rng.uniform(-1, 1, NV) if dt else None
        self.norm_w = 1 + 0.2 * rng.standard_normal(DV)
        f32 = np.float32
        self.consts = [
            kernels.upload(w_stored),
            kernels.upload(self.A.astype(f32)),
            kernels.upload(self.dt_bias.astype(f32)) if dt else 0,
            kernels.upload(self.norm_w.astype(f32)),
        ]

    def reference(self) -> Reference:
        return Reference(self.case, self.w, self.A, self.dt_bias, self.norm_w)

    def inputs(self, T: int):
        NV, DV = self.case[1], self.case[3]
        f32, rng = np.float32, self.rng
        x = rng.standard_normal((T, self.C)).astype(f32)
        z = rng.standard_normal((T, NV * DV)).astype(f32)
        b, a = (rng.standard_normal((T, NV)).astype(f32) for _ in range(2))
        return x, z, b, a

    def args(self, x, z, b, a, conv_state, ssm_state, y, ldy, pos=None, seq=None):
        """The kernel's arguments; rows of one sequence in slot 0 unless `pos`/`seq` say."""
        NK, NV, DK, DV = self.case[:4]
        T, R, k = len(x), NV // NK, self.kernels
        if self.packed:
            xz = pack_qkvz(x, z, NK, DK, R, DV)
            ba = np.concatenate([b.reshape(T, NK, R), a.reshape(T, NK, R)], -1).reshape(T, -1)
            xz_d, ba_d = k.upload(xz), k.upload(ba)
            acts = [(xz_d, xz.shape[1]), (xz_d, xz.shape[1]), (ba_d, 2 * NV), (ba_d, 2 * NV)]
        else:
            # column views of wider projection outputs, as the memory plan lays them out
            wide = [np.pad(m, ((0, 0), (0, 3))) for m in (x, z, b, a)]
            acts = [(k.upload(m), m.shape[1]) for m in wide]
        args = [("i32", T)]
        for ptr, ld in acts:
            args += [("u64", ptr), ("i32", ld)]
        args += [("u64", ptr) for ptr in self.consts]
        pos = np.arange(T) if pos is None else pos
        seq = np.zeros(T) if seq is None else seq
        rows = [k.upload(np.asarray(v, np.int32)) for v in (pos, seq)]
        args += [("u64", conv_state), ("u64", ssm_state), ("u64", y), ("i32", ldy)]
        return [*args, *(("u64", r) for r in rows)]


def run_step(kernels, name, layer, args, T, chunks):
    """One step: the chunked kernels `chunks` ((kernels, params) or None) where T is a chunk
    or more, else the token-serial one."""
    if chunks is not None and chunks[1].chunk <= T:
        k, p = chunks
        work = kernels.poisoned((chunk_work_bytes(p, T) // 4,))
        for kernel, grid, threads in chunk_launches(p, k):
            dims = tuple(eval_dim(d, T, T) for d in grid)
            kernels.launch(kernel, dims, threads, [*args, ("u64", work)])
        return
    fn, threads = kernels.specs[name]
    kernels.launch(fn, (layer.case[0], T), threads, args)


def check_steps(kernels, name: str, chunks=None, slot: int = 0) -> None:
    """`slot`: the sequence's slot of pools of slot + 2 (the others must stay untouched)."""
    _, NV, DK, DV, KC, *_, steps = CASES[name]
    if chunks is not None:
        steps = CHUNKED[name][1]
    layer = Layer(kernels, name)
    C = layer.C
    ref = layer.reference()
    f32 = np.float32
    W, n = KC - 1 or 1, slot + 2
    conv_state = kernels.upload(np.zeros((n, W, C), f32))
    ssm_state = kernels.upload(np.zeros((n, NV, DK, DV), f32))
    start = 0
    try:
        for i, T in enumerate(steps):
            x, z, b, a = layer.inputs(T)
            ldy = NV * DV + 5
            y = kernels.poisoned((T, ldy))
            pos, seq = np.arange(start, start + T), np.full(T, slot)
            args = layer.args(x, z, b, a, conv_state, ssm_state, y, ldy, pos, seq)
            run_step(kernels, name, layer, args, T, chunks)
            start += T
            got = kernels.read(y, (T, ldy))[:, : NV * DV]
            want = ref.step(x.astype(np.float64), z, b, a)
            assert not np.isnan(got).any(), (name, i, "outputs left unwritten")
            assert rel_err(got, want) <= 1e-4, (name, i, rel_err(got, want))
            got_s = kernels.read(ssm_state, (n, NV, DK, DV))
            assert rel_err(got_s[slot], ref.S) <= 1e-4, (name, i, "state", rel_err(got_s, ref.S))
            got_c = kernels.read(conv_state, (n, W, C))
            others = [k for k in range(n) if k != slot]
            assert not got_s[others].any() and not got_c[others].any(), (name, i, "other slots")
            if KC > 1:
                assert np.array_equal(got_c[slot], ref.conv.astype(f32)), (name, i, "conv window")
    finally:
        kernels.free()


def check_forms(kernels, name: str, T: int, chunks) -> None:
    """One T-token step from the same random states through the token-serial kernel and
    through the chunked ones: outputs (NaN-poisoned) and both states agree."""
    _, NV, DK, DV, KC = CASES[name][:5]
    layer = Layer(kernels, name)
    f32 = np.float32
    conv0 = layer.rng.standard_normal((KC - 1 or 1, layer.C)).astype(f32)
    ssm0 = (0.1 * layer.rng.standard_normal((NV, DK, DV))).astype(f32)
    x, z, b, a = layer.inputs(T)
    ldy = NV * DV + 5
    out = []
    try:
        for use in (None, chunks):
            conv_state, ssm_state = kernels.upload(conv0), kernels.upload(ssm0)
            y = kernels.poisoned((T, ldy))
            args = layer.args(x, z, b, a, conv_state, ssm_state, y, ldy)
            run_step(kernels, name, layer, args, T, use)
            out.append(
                (
                    kernels.read(y, (T, ldy))[:, : NV * DV],
                    kernels.read(ssm_state, (NV, DK, DV)),
                    kernels.read(conv_state, conv0.shape),
                )
            )
        (ys, ss, cs), (yc, sc, cc) = out
        assert not np.isnan(yc).any() and not np.isnan(ys).any(), (name, "outputs left unwritten")
        assert rel_err(yc, ys) <= 1e-4, (name, "outputs", rel_err(yc, ys))
        assert rel_err(sc, ss) <= 1e-4, (name, "state", rel_err(sc, ss))
        assert np.array_equal(cc, cs), (name, "conv window")
    finally:
        kernels.free()


# steps of rows of several sequences (slots 0..2; 3 is the spare slot of padding rows): each
# (slot, tokens) a run of that sequence's next tokens, in the order the step holds them
BATCH_STEPS = (
    ((1, 5), (0, 1), (2, 3)),
    ((0, 1), (1, 1), (2, 1), (3, 1), (3, 1)),
    ((2, 7), (0, 2)),
    ((1, 1), (2, 1), (0, 4)),
)


def check_batch(kernels, name: str) -> None:
    """BATCH_STEPS through the token-serial kernel on pools of four slots: each sequence's
    rows (NaN-poisoned first) and its slot of both states after every step are what its own
    NumPy recurrence gives; padding rows write only the spare slot."""
    _, NV, DK, DV, KC, *_ = CASES[name]
    layer = Layer(kernels, name)
    C, f32 = layer.C, np.float32
    refs = [layer.reference() for _ in range(3)]
    at = [0, 0, 0]
    conv_state = kernels.upload(np.zeros((4, KC - 1 or 1, C), f32))
    ssm_state = kernels.upload(np.zeros((4, NV, DK, DV), f32))
    try:
        for i, runs in enumerate(BATCH_STEPS):
            T = sum(n for _, n in runs)
            x, z, b, a = layer.inputs(T)
            pos, seq = [], []
            for slot, n in runs:
                start = at[slot] if slot < 3 else 0
                pos += list(range(start, start + n)) if slot < 3 else [0] * n
                seq += [slot] * n
            ldy = NV * DV + 5
            y = kernels.poisoned((T, ldy))
            args = layer.args(x, z, b, a, conv_state, ssm_state, y, ldy, pos, seq)
            fn, threads = kernels.specs[name]
            kernels.launch(fn, (layer.case[0], T), threads, args)
            got = kernels.read(y, (T, ldy))[:, : NV * DV]
            S = kernels.read(ssm_state, (4, NV, DK, DV))
            conv = kernels.read(conv_state, (4, KC - 1 or 1, C))
            row = 0
            for slot, n in runs:
                if slot < 3:
                    r = slice(row, row + n)
                    want = refs[slot].step(x[r].astype(np.float64), z[r], b[r], a[r])
                    assert rel_err(got[r], want) <= 1e-4, (name, i, slot, rel_err(got[r], want))
                    at[slot] += n
                row += n
            for slot, ref in enumerate(refs):
                assert rel_err(S[slot], ref.S) <= 1e-4, (name, i, slot, "state")
                if KC > 1:
                    assert np.array_equal(conv[slot], ref.conv.astype(f32)), (name, i, slot)
    finally:
        kernels.free()
