"""Single kernels on a real GPU, without a model or a plan (tests/gpu).

`DeviceKernels` opens the first GPU found (cuda, else hip; the test is skipped with
neither), builds the rendered kernels into one code object with the arch's toolchain, and
launches them through the backends' driver layer with gpu_common.PackedArgs, the way the
runtime does. Buffers it uploads are freed by `free()`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from hipc.base.version import HIPC_VERSION
from hipc.compiler.codegen.environment import render
from hipc.compiler.codegen.hip import program_source
from hipc.compiler.passes.repack import split_quant_blocks
from hipc.compiler.toolchains.gpu import gpu_toolchain
from hipc.runtime.backends import cuda, hip
from hipc.runtime.backends.gpu_common import DEFAULT_SHARED_LIMIT, PackedArgs

POISON = np.float32(np.nan)  # outputs start as NaN: a value a kernel forgot to write shows


def open_driver():
    if cuda.probe()[0]:
        return cuda.CudaDriver(0)
    if hip.probe()[0]:
        return hip.HipDriver(0)
    pytest.skip("no GPU")


def kernels_source(specs, arch: str, quant_layout: str = "split") -> str:
    """One program of the rendered kernels `specs` ([(fn, template, ctx, shared)])."""
    sources = [render(f"hip/{t}.hip.j2", fn=fn, **ctx) for fn, t, ctx, _ in specs]
    return program_source("kernel_test", HIPC_VERSION, arch, sources, quant_layout)


def compiled(source: str, arch: str, cache: Path | None = None) -> bytes:
    """The code object of `source`; with `cache`, looked up there by the source's sha256 (a
    benchmark can build its many variants ahead of time on a machine with no GPU)."""
    key = cache / f"{hashlib.sha256(source.encode()).hexdigest()[:24]}.{arch}" if cache else None
    if key is not None and key.exists():
        return key.read_bytes()
    blob = gpu_toolchain(arch).compile(source)
    if key is not None:
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(blob)
    return blob


class DeviceKernels:
    def __init__(self, build, quant_layout: str = "split", cache: Path | None = None) -> None:
        """`build(arch)` -> [(fn, template, ctx, dynamic shared bytes or None: a template of
        several kernels, found by name at launch)] to compile;
        `quant_layout`: how the weights uploaded store quantized blocks (see pack);
        `cache`: a folder of code objects by source hash (see compiled; default: the
        HIPC_KERNEL_CACHE environment variable's, else none)."""
        if cache is None and os.environ.get("HIPC_KERNEL_CACHE"):
            cache = Path(os.environ["HIPC_KERNEL_CACHE"])
        self.d = open_driver()
        self.arch = self.d.arch
        specs = build(self.arch)
        source = kernels_source(specs, self.arch, quant_layout)
        self.d.load_module(compiled(source, self.arch, cache))
        self.fns = {}
        for fn, _, _, shared in specs:
            if shared is None:  # a source of several kernels (or none): looked up when launched
                continue
            self.fns[fn] = f = self.d.get_function(fn)
            if shared > DEFAULT_SHARED_LIMIT:
                self.d.set_dynamic_shared(f, shared)
        self.allocs: list[int] = []
        self.opted_in: dict[str, int] = {}  # kernels' dynamic shared bytes set above the default

    def function(self, name: str):
        if name not in self.fns:
            self.fns[name] = self.d.get_function(name)
        return self.fns[name]

    def upload(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        ptr = self.d.malloc(max(a.nbytes, 4))
        self.allocs.append(ptr)
        self.d.h2d(ptr, a.ctypes.data, a.nbytes)
        return ptr

    def poisoned(self, shape) -> int:
        return self.upload(np.full(shape, POISON, np.float32))

    def launch(self, name: str, grid, block: int, args: list[tuple[str, int]], shared: int = 0):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        packed = PackedArgs(args)
        fn = self.function(name)
        if shared > max(DEFAULT_SHARED_LIMIT, self.opted_in.get(name, 0)):
            self.d.set_dynamic_shared(fn, shared)  # as the runtime does for a plan's launches
            self.opted_in[name] = shared
        self.d.launch(fn, grid, (block, 1, 1), shared, packed.address)

    def read(self, ptr: int, shape, dtype=np.float32) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.d.d2h(out.ctypes.data, ptr, out.nbytes)
        self.d.synchronize()
        return out

    def free(self) -> None:
        for ptr in self.allocs:
            self.d.free(ptr)
        self.allocs = []

    def close(self) -> None:
        self.free()
        self.d.close()


def held_x(x: np.ndarray, activations: str) -> np.ndarray:
    """x (float32) as a quantized GEMV holds it (prelude: hipc_stage_xq), float64: per 32
    values d = max|x| / 127 and hi = rint(x * 127 / max|x|) in float32 as the kernel rounds;
    int8 activations d * hi, int16 also lo = rint((x - hi d) 127 * 254 / max|x|) clamped to
    +-127, d / 254 * (254 hi + lo)."""
    xb = x.astype(np.float32).reshape(-1, 32)
    am = np.abs(xb).max(1, keepdims=True)
    d = am / np.float32(127)
    inv = np.where(am > 0, np.float32(127) / np.where(am > 0, am, 1), 0).astype(np.float32)
    hi = np.rint(xb * inv)
    if activations == "int8":
        return (d.astype(np.float64) * hi).reshape(-1)
    lo = np.clip(np.rint((xb - hi * d) * inv * np.float32(254)), -127, 127)
    dq = (d / np.float32(254)).astype(np.float64)
    return (dq * (254 * hi.astype(np.float64) + lo)).reshape(-1)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bfloat16 (ties to even, as the prelude's
    hipc_f32_to_bf16), as float64."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def experts_bf16_once(x, ids, w, gate, up, down) -> np.ndarray:
    """The routed experts' sum (no residual) with x and each act row rounded to bf16, as the
    grouped prefill GEMMs take them at --prefill-precision bf16; float64 otherwise."""
    xb = bf16_round(x)
    T, k = ids.shape
    out = np.zeros((T, down.shape[1]))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = xb[t] @ gate[e].T, xb[t] @ up[e].T
            out[t] += w[t, j] * (down[e] @ bf16_round(g / (1 + np.exp(-g)) * u))
    return out


# -- weights in their storage types -----------------------------------------------------


def pack(w: np.ndarray, wtype: str, layout: str = "split") -> tuple[np.ndarray, np.ndarray]:
    """(bytes as a GPU artifact stores them, the exact values they hold) for a float matrix
    [N, K]. Quantized blocks are made here as GGUF stores them, then split as the artifact
    writer does when `layout` is "split"."""
    N, K = w.shape
    if wtype == "float32":
        return w.astype(np.float32), w.astype(np.float32).astype(np.float64)
    if wtype == "float16":
        h = w.astype(np.float16)
        return h, h.astype(np.float64)
    if wtype == "bfloat16":
        bits = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if wtype in ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "q3_k", "q2_k"):
        return _pack_gguf(w, wtype, layout)
    blocks = w.reshape(N, K // 32, 32)
    if wtype == "q8_0":
        d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
        q = np.round(blocks / np.maximum(d[..., None].astype(np.float64), 1e-12)).astype(np.int8)
        raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
        vals = d[..., None].astype(np.float64) * q
        return _layout(raw.reshape(N, -1), wtype, layout), vals.reshape(N, K)
    lo, hi = blocks.min(-1), blocks.max(-1)
    if wtype == "q4_0":
        d = (np.maximum(-lo, hi) / 7.5).astype(np.float16)
        q = np.clip(
            np.round(blocks / np.maximum(d[..., None].astype(np.float64), 1e-12)) + 8, 0, 15
        )
        vals = d[..., None].astype(np.float64) * (q - 8)
        head = d[..., None].view(np.uint8)
    else:  # q4_1: d * q + m
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        q = np.clip(
            np.round((blocks - m[..., None]) / np.maximum(d[..., None].astype(np.float64), 1e-12)),
            0,
            15,
        )
        vals = d[..., None].astype(np.float64) * q + m[..., None].astype(np.float64)
        head = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8)], -1)
    q = q.astype(np.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)  # element j < 16: low nibble; j >= 16: high
    raw = np.concatenate([head, nib], axis=-1)
    return _layout(raw.reshape(N, -1), wtype, layout), vals.reshape(N, K)


def _layout(raw: np.ndarray, wtype: str, layout: str) -> np.ndarray:
    return split_quant_blocks(raw, wtype) if layout == "split" else raw


def _pack_gguf(w: np.ndarray, wtype: str, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Blocks quantized by gguf-py (Q5_0, Q5_1) or random (the K-quants, IQ4_NL: gguf-py has
    no quantizer for them; every quant and scale byte is valid, extremes included, and the
    f16 d (and dmin) are set sane), with their values by gguf-py's dequantize."""
    import gguf

    N, K = w.shape
    qt = getattr(gguf.GGMLQuantizationType, wtype.upper())
    if wtype in ("q5_0", "q5_1"):
        raw = gguf.quants.quantize(w.astype(np.float32), qt)
    else:
        size, at, n, bv = {
            "q6_k": (210, 208, 1, 256),
            "q3_k": (110, 108, 1, 256),
            "q2_k": (84, 80, 2, 256),
            "q4_k": (144, 0, 2, 256),
            "q5_k": (176, 0, 2, 256),
            "iq4_nl": (18, 0, 1, 32),
            "iq4_xs": (136, 0, 1, 256),
        }[wtype]
        # seeded by w too: two matrices of one shape (an expert's gate and up) get other blocks
        rng = np.random.default_rng(
            [N, K, *np.frombuffer(w.astype(np.float32).tobytes()[:16], np.uint32)]
        )
        raw = rng.integers(0, 256, (N * K // bv, size), dtype=np.uint8)
        # Q3_K: |q - 4| <= 4 and no offset, Q2_K: q <= 3 under 4-bit scales (Q4_K: 15 under
        # 6-bit ones, and a min that keeps sums from cancelling), so larger d for outputs of a
        # like size
        d_max = {"q3_k": 2e-3, "q2_k": 4e-3}.get(wtype, 4e-5)
        d = rng.uniform(d_max / 4, d_max, (len(raw), n)).astype(np.float16)
        raw[:, at : at + 2 * n] = d.view(np.uint8).reshape(len(raw), 2 * n)
        raw = raw.reshape(N, -1)
    vals = gguf.quants.dequantize(raw, qt)
    return _layout(raw, wtype, layout), vals.reshape(N, K).astype(np.float64)


# Attention test cases (tests/gpu and the host tests) are tuples whose first six fields are
# (NH, NKV, D, window, qk norm, interleaved pairs), then per file; a Qwen3.5-style case ends
# with (rot, out_gate), an OLMoE-style one with (rot, out_gate, clip).
def attention_switches(case) -> tuple[int, bool]:
    """(rot, out_gate) of a case: 0 (all dims rotate) and no gate unless it names them."""
    return tuple(case[9:11]) if len(case) > 9 else (0, False)


def attention_clip(case) -> float:
    """The bound q, k and v are clamped to (OLMoE's clip_qkv) where a case names one, else 0."""
    return float(case[11]) if len(case) > 11 else 0.0


def attention_params(case, eps: float):
    """The AttentionParams of a case; `eps` the q/k norm's epsilon where the case has one."""
    from hipc.compiler.kernels.attention import AttentionParams

    NH, NKV, D, window, norm, interleaved, *_ = case
    rot, gate = attention_switches(case)
    return AttentionParams(
        NH=NH, NKV=NKV, D=D, scale=float(D) ** -0.5, window=window, interleaved=interleaved,
        norm_eps=eps if norm else 0.0, rot=rot, out_gate=gate, clip=attention_clip(case),
    )  # fmt: skip


def rope(x: np.ndarray, c: np.ndarray, s: np.ndarray, interleaved: bool) -> np.ndarray:
    """x's pairs rotated by angles with cosines c and sines s: (2i, 2i+1) when interleaved,
    else (i, i + D/2), as the attention kernels pair them."""
    h = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :h], x[..., h:])
    ra, rb = a * c - b * s, b * c + a * s
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :h], out[..., h:] = ra, rb
    return out


# Prefill attention test cases (tests/gpu/test_prefill_attention.py, the host flash test):
# (NH, NKV, D, window, qk norm, interleaved pairs, KV storage, start, T[, rot, out_gate]).
# the compiled context the prefill attention tests render their kernels for: the stride of the
# block tables (ceil(PREFILL_CTX / KV_BLOCK) entries per sequence) and the RoPE tables' rows
PREFILL_CTX = 1024


def prefill_attention_inputs(case, seed: int, segments=None, ctx: int = PREFILL_CTX) -> dict:
    """Random q (a column view: ldq wider than the heads), q-norm weight, RoPE tables, and the
    step's rows: `segments` [(sequence, first position, rows)] (default: sequence 0's rows
    start..start+T-1 of the case), each sequence's rows consecutive. Every sequence's positions
    0..its last row's are in paged KV pools as rope_kv leaves them (keys already rotated, in
    the storage type), in blocks scattered over the pool through its block table; every slot
    no sequence owns is NaN: nothing there may be read. kc/vc are the pools, logical[s] a
    sequence's (keys, values) by position. `ctx`: the compiled context (the tables' stride,
    the RoPE tables' rows)."""
    from hipc.base.launch_plan import KV_BLOCK
    from hipc.compiler.reference.executor import round_bf16

    NH, NKV, D, _, _, _, kv, start, T = case[:9]
    rot, gated = attention_switches(case)
    segments = segments or [(0, start, T)]
    pos = np.concatenate([np.arange(a, a + n) for _, a, n in segments]).astype(np.int32)
    seq = np.concatenate([[s] * n for s, _, n in segments]).astype(np.int32)
    T = len(pos)
    rng = np.random.default_rng(seed)
    ldq = NH * (2 * D if gated else D) + 40
    q = rng.standard_normal((T, ldq)).astype(np.float32) * 2
    qw = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    ang = rng.uniform(0, 2 * np.pi, (ctx, (rot or D) // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    store = round_bf16 if kv == "bfloat16" else (lambda a: a.astype(np.float32))
    n_seq = int(seq.max()) + 1
    held = [int(pos[seq == s].max()) + 1 if (seq == s).any() else 0 for s in range(n_seq)]
    need = [-(-n // KV_BLOCK) for n in held]
    pool_blocks = sum(need) + 7
    order = iter(rng.permutation(pool_blocks))
    tables = np.full((n_seq, -(-ctx // KV_BLOCK)), -1, np.int32)
    kc, vc = (np.full((pool_blocks * KV_BLOCK, NKV, D), np.nan, np.float32) for _ in range(2))
    logical = {}
    for s in range(n_seq):
        tables[s, : need[s]] = [next(order) for _ in range(need[s])]
        slots = (tables[s, : need[s], None] * KV_BLOCK + np.arange(KV_BLOCK)).reshape(-1)
        slots = slots[: held[s]]
        for c in (kc, vc):
            c[slots] = store(rng.standard_normal((held[s], NKV, D)).astype(np.float32) * 2)
        logical[s] = (kc[slots], vc[slots])
    return dict(q=q, ldq=ldq, qw=qw, cos_t=cos_t, sin_t=sin_t, kc=kc, vc=vc, pos=pos, seq=seq,
                tables=tables, logical=logical, T=T)  # fmt: skip


def as_stored(a: np.ndarray, kv: str) -> np.ndarray:
    """A float32 cache (already rounded for bfloat16) as the kernels read it."""
    return (a.view(np.uint32) >> 16).astype(np.uint16) if kv == "bfloat16" else a


def prefill_attention_reference(
    case, x: dict, eps: float, bf16_operands: bool = False
) -> np.ndarray:
    """Causal (windowed) grouped-query softmax attention of case's inputs x in float64, each
    row over its own sequence's positions, q clamped, normed and rotated, the output gated where the
    case says: [T, NH * D]. `bf16_operands`: q (times the flash kernel's scale * log2 e) and
    K, V rounded to bf16 first, as the flash kernel multiplies them, which leaves its rounding
    of the softmax weights as the difference."""
    from hipc.compiler.reference.executor import round_bf16

    NH, NKV, D, window, norm, interleaved = case[:6]
    rot, gated = attention_switches(case)
    QW = 2 * D if gated else D
    q, qw, pos, seq, T = x["q"], x["qw"], x["pos"], x["seq"], x["T"]
    qh = q[:, : NH * QW].reshape(T, NH, QW)[..., :D].astype(np.float64)
    if clip := attention_clip(case):
        qh = np.clip(qh, -clip, clip)
    if norm:
        qh = qh / np.sqrt(np.mean(qh * qh, -1, keepdims=True) + eps) * qw
    r = rot or D
    qh[..., :r] = rope(qh[..., :r], x["cos_t"][pos][:, None], x["sin_t"][pos][:, None], interleaved)
    if bf16_operands:
        c = D**-0.5 * np.log2(np.e)
        qh = round_bf16(qh * c).astype(np.float64) / c
    want = np.empty((T, NH, D))
    group = NH // NKV
    for t in range(T):
        p = int(pos[t])
        lo = max(0, p - window + 1) if window else 0
        kc, vc = x["logical"][int(seq[t])]
        if bf16_operands:
            kc, vc = round_bf16(kc), round_bf16(vc)
        keys, vals = kc[lo : p + 1].astype(np.float64), vc[lo : p + 1].astype(np.float64)
        for h in range(NH):
            sc = keys[:, h // group] @ qh[t, h] * D**-0.5
            e = np.exp(sc - sc.max())
            want[t, h] = e @ vals[:, h // group] / e.sum()
    if gated:
        gate = q[:, : NH * QW].reshape(T, NH, QW)[..., D:].astype(np.float64)
        want = want / (1 + np.exp(-gate))
    return want.reshape(T, NH * D)
