"""repack: merge linear layers that read the same input into one wider one.

q, k, v (and gate, up) each read the same normalized activations; one Linear over
their weights concatenated by rows reads those activations once, is one kernel
instead of three, and a Split names the parts again. Rows of quantized weights are
independent, so concatenating them keeps the blocks as they are.

Only weights of one storage type merge (a kernel reads one block format). Mixed files
(llama.cpp's Q4_K_M keeps v in another type than q and k) leave a norm read by several
Linears; split_shared_norms gives each its own copy to fuse as a prologue.
"""

from __future__ import annotations

import numpy as np

from hipc.compiler.ir import Constant, Graph, Node, PackedWeight, WeightRef
from hipc.compiler.passes.rewrite import Rewriter
from hipc.compiler.source.reader import WeightReader


def merge_parallel_linears(graph: Graph, reader: WeightReader | None = None) -> Graph:
    reader = reader or WeightReader()
    groups: dict[tuple[str, str, bool], list[Node]] = {}
    for n in graph.nodes:
        if n.op == "hipc::Linear" and isinstance(graph.initializers.get(n.inputs[1]), WeightRef):
            key = (n.inputs[0], graph.values[n.inputs[1]].dtype, len(n.inputs) > 2)
            groups.setdefault(key, []).append(n)
    readers = _readers(graph)
    merged = {
        part[0].name: part
        for g in groups.values()
        for part in _kernel_shaped(readers, g)
        if len(part) > 1
    }
    skip = {n.name for g in merged.values() for n in g[1:]}

    rw = Rewriter(graph)
    for node in graph.nodes:
        if node.name in skip:
            continue
        if node.name not in merged:
            rw.copy(node)
            continue
        parts = merged[node.name]
        name = _merged_name([p.outputs[0] for p in parts])
        refs = tuple(graph.initializers[p.inputs[1]] for p in parts)
        inputs = [parts[0].inputs[0], rw.keep_initializer(f"{name}.weight", PackedWeight(refs))]
        if len(parts[0].inputs) > 2:
            biases = [
                reader.value(graph.initializers[p.inputs[2]])
                if p.inputs[2] in graph.initializers
                else None
                for p in parts
            ]
            if any(b is None for b in biases):
                # NOTE: a bias computed by the graph cannot be packed at compile time
                for p in parts:
                    rw.copy(p)
                continue
            inputs.append(
                rw.keep_initializer(
                    f"{name}.bias", Constant(np.concatenate(biases).astype(np.float32))
                )
            )
        wide = rw.emit("Linear", inputs, [name], name, domain="hipc").outputs[0]
        sizes = [graph.values[p.inputs[1]].shape[0] for p in parts]
        rw.emit(
            "Split",
            [wide],
            [p.outputs[0] for p in parts],
            f"{name}.split",
            {"axis": -1, "split": sizes},
        )
    return split_shared_norms(rw.finish())


def _kernel_shaped(readers: Readers, linears: list[Node]) -> list[list[Node]]:
    """Linears reading one input -> the sets to merge: each gate/up pair of a gated MLP on
    its own (its Split feeds the GLU epilogue, which takes two equal halves), the rest
    together (a Split of column views). Qwen2-MoE's sparse block reads its norm with the
    router, the shared expert's gate and up and its sigmoid gate: [router + expert_gate]
    and [gate + up], not one 4-way Split no epilogue can take."""
    produced = {n.outputs[0]: n for n in linears}
    pairs: list[list[Node]] = []
    for n in linears:
        act = _only(readers, n.outputs[0])
        if act is None or act.op not in ("hipc::SiLU", "Gelu"):
            continue
        mul = _only(readers, act.outputs[0])
        if mul is None or mul.op != "Mul":
            continue
        other = next((i for i in mul.inputs if i != act.outputs[0]), None)
        up = produced.get(other)
        if up is not None and up is not n and _only(readers, other) is mul:
            pairs.append([n, up])
    paired = {m.name for pair in pairs for m in pair}
    return [*pairs, [n for n in linears if n.name not in paired]]


Readers = dict[str, list[Node | None]]


def _readers(graph: Graph) -> Readers:
    """value -> the nodes reading it, and None for the graph's output."""
    out: Readers = {}
    for n in graph.nodes:
        for i in n.inputs:
            out.setdefault(i, []).append(n)
    for o in graph.outputs:
        out.setdefault(o, []).append(None)
    return out


def _only(readers: Readers, value: str) -> Node | None:
    users = readers.get(value, [])
    return users[0] if len(users) == 1 else None


def split_residual_sums(graph: Graph) -> Graph:
    """x + (a + b), the inner sum read only there -> (x + a) + b, a produced first.

    Qwen2-MoE adds its routed experts and its gated shared expert, then the residual:
    as two residual Adds, each branch's kernel takes one as its epilogue (the experts
    kernel, then the shared expert's down projection), and the residual stream is updated
    in place twice instead of a sum being written and read back."""
    order = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    readers = _readers(graph)
    inner: dict[str, Node] = {}
    for n in graph.nodes:
        user = _only(readers, n.outputs[0]) if n.op == "Add" else None
        if user is not None and user.op == "Add" and list(user.inputs).count(n.outputs[0]) == 1:
            inner[user.name] = n
    if not inner:
        return graph
    rw = Rewriter(graph)
    drop = {n.name for n in inner.values()}
    for node in graph.nodes:
        if node.name in drop:
            continue
        if node.name not in inner:
            rw.copy(node)
            continue
        sum_ = inner[node.name]
        x = next(i for i in node.inputs if i != sum_.outputs[0])
        a, b = sorted(sum_.inputs, key=lambda v: order.get(v, -1))
        first = rw.emit("Add", [x, a], [f"{node.outputs[0]}.0"], f"{node.name}.0").outputs[0]
        rw.emit("Add", [first, b], node.outputs, node.name)
    return rw.finish()


def split_shared_norms(graph: Graph) -> Graph:
    """An RMSNormalization read only by several Linears -> one copy per Linear.

    Each copy then fuses into its Linear as the prologue: recomputing the norm of T x K
    values costs less than writing and re-reading them, and no target needs a kernel
    for a norm on its own.
    """
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        users = graph.consumers(n.outputs[0]) if n.op == "RMSNormalization" else []
        if (
            len(users) > 1
            and n.outputs[0] not in graph.outputs
            and all(
                u.op == "hipc::Linear" and list(u.inputs).count(n.outputs[0]) == 1 for u in users
            )
            and all(u.inputs[0] == n.outputs[0] for u in users)
        ):
            readers[n.name] = users
    if not readers:
        return graph
    reads: dict[str, str] = {}  # Linear -> the copy it reads
    rw = Rewriter(graph)
    for node in graph.nodes:
        if node.name in readers:
            for i, user in enumerate(readers[node.name]):
                tag = "" if i == 0 else f"@{user.name}"
                out = f"{node.outputs[0]}{tag}"
                rw.emit(
                    node.op_type, node.inputs, [out], f"{node.name}{tag}", node.attrs, node.domain
                )
                reads[user.name] = out
        elif node.name in reads:
            inputs = [reads[node.name], *node.inputs[1:]]
            rw.emit(node.op_type, inputs, node.outputs, node.name, dict(node.attrs), node.domain)
        else:
            rw.copy(node)
    return rw.finish()


def _merged_name(names: list[str]) -> str:
    """l0.q, l0.k, l0.v -> l0.q+k+v"""
    prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
    if all(n.startswith(prefix) for n in names):
        return prefix + "+".join(n[len(prefix) :] for n in names)
    return "+".join(names)


# Quantized types whose blocks GPU kernels read split: each block's fields as (offset,
# bytes), in the order of the regions they are gathered into. GGUF interleaves them
# ({d, quants} per 32 weights; Q6_K: {ql, qh, scales, d} per 256). Q4_K and Q5_K keep their
# 16-byte head {d, dmin, scales} whole: a GEMV lane reads it with one load (prelude: hipc_qmatk).
SPLIT_BLOCKS = {
    "q4_0": ((2, 16), (0, 2)),
    "q4_1": ((4, 16), (0, 4)),
    "q8_0": ((2, 32), (0, 2)),
    "q6_k": ((0, 192), (192, 16), (208, 2)),
    "q3_k": ((0, 96), (96, 12), (108, 2)),
    "q2_k": ((16, 64), (0, 16), (80, 4)),
    "q5_0": ((6, 16), (2, 4), (0, 2)),
    "q5_1": ((8, 16), (4, 4), (0, 4)),
    "q4_k": ((16, 128), (0, 16)),
    "q5_k": ((16, 160), (0, 16)),
    "iq4_nl": ((2, 16), (0, 2)),
    "iq4_xs": ((8, 128), (4, 4), (0, 4)),
}


def split_quant_blocks(stored: np.ndarray, dtype: str) -> np.ndarray:
    """GGUF blocks [rows, row bytes] -> one region per block field (quants of every block
    in order, then scales, ...: templates/hip/prelude.h, hipc_qmat). Same bytes and shape."""
    fields = SPLIT_BLOCKS[dtype]
    blocks = np.ascontiguousarray(stored).reshape(-1, sum(n for _, n in fields))
    out = np.concatenate([blocks[:, o : o + n].reshape(-1) for o, n in fields])
    return out.reshape(stored.shape)


# Quantized types the CPU kernels read in row lanes (templates/cpu/linear_lanes.h) where the
# build machine has AVX512-VNNI: block bytes, the scale field (offset, bytes), the fifth
# bits' offset (Q5) and the quants (offset, bytes).
LANE_BLOCKS = {
    "q4_0": (18, (0, 2), None, (2, 16)),
    "q4_1": (20, (0, 4), None, (4, 16)),
    "q5_0": (22, (0, 2), 2, (6, 16)),
    "q5_1": (24, (0, 4), 4, (8, 16)),
    "q8_0": (34, (0, 2), None, (2, 32)),
}
# a block's 32 elements in the lanes' chunk order (linear_vnni.h chunk_elem: chunk j holds
# elements 16 * (j & 1) + 4 * (j >> 1) ... + 3)
_CHUNK_ORDER = [16 * (j & 1) + 4 * (j >> 1) + i for j in range(8) for i in range(4)]
# How a lanes block's (a Q5_K unit's) 512 fifth bits are arranged, 64 bytes either way (lane
# r = row r, element i of chunk j): "masks", bit 4r + i of qword j (AVX512: one k-mask a
# chunk), or "bytes", bit j of byte 4r + i (AVX2: a chunk's bits one shift away from bit 4 of
# every byte; linear_lanes_avx2.h). passes/lanes.py fifth_form picks the build machine's.
FIFTH_FORMS = ("masks", "bytes")
FIFTH_TYPES = ("q5_0", "q5_1", "q5_k")  # the lanes types with fifth bits


def lane_quant_blocks(stored: np.ndarray, dtype: str, fifth: str = "masks") -> np.ndarray:
    """GGUF blocks [rows, row bytes] -> the lanes layout (linear_lanes.h): rows in groups of
    16 (padded with zero blocks to a multiple of 16 rows), lane r = row r; a group's blocks
    in pairs, each pair its two blocks' quants, then their fifth bits (Q5, as `fifth` of
    FIFTH_FORMS), then their scales (a last odd block alone). Same bytes a row; one
    sequential stream a group. K-quants: lane_kquant_blocks."""
    if fifth not in FIFTH_FORMS:
        raise ValueError(f"fifth: {fifth!r} is not one of {FIFTH_FORMS}")
    if dtype in LANE_KQUANTS:
        return lane_kquant_blocks(stored, dtype, fifth)
    size, (so, sn), qh, (qo, qn) = LANE_BLOCKS[dtype]
    rows, rb = stored.shape
    nb, groups = rb // size, -(-rows // 16)
    blocks = np.zeros((groups * 16, nb, size), np.uint8)
    blocks[:rows] = np.ascontiguousarray(stored).reshape(rows, nb, size)
    blocks = blocks.reshape(groups, 16, nb, size)

    def lanes(a: np.ndarray, chunk: int) -> np.ndarray:
        """[G, 16 rows, nb, bytes] -> [G, nb, bytes / chunk * 16 rows * chunk]: lane = row"""
        g, r, n, b = a.shape
        return a.reshape(g, r, n, b // chunk, chunk).transpose(0, 2, 3, 1, 4).reshape(g, n, -1)

    qs = blocks[..., qo : qo + qn]
    regions = []
    if qn == 32:  # Q8_0: the signed bytes as u = q + 128, in chunk order
        regions.append(lanes(qs[..., _CHUNK_ORDER] ^ 0x80, 4))
    else:
        regions.append(lanes(qs, 4))  # dword c: elements 4c.. (low nibbles), 16 + 4c.. (high)
    if qh is not None:
        bits = np.unpackbits(blocks[..., qh : qh + 4], axis=-1, bitorder="little")
        if fifth == "bytes":  # byte 4r + i, bit j: row r's element _CHUNK_ORDER[4j + i]
            chunks = bits[..., _CHUNK_ORDER].reshape(groups, 16, nb, 8, 4)
            regions.append(lanes(_pack_fields(chunks, 1), 4))
        else:  # qword j, bit 4r + i: row r's element _CHUNK_ORDER[4j + i]
            sel = lanes(bits[..., _CHUNK_ORDER], 4).reshape(groups, nb, 8, 64)
            regions.append(np.packbits(sel, axis=-1, bitorder="little").reshape(groups, nb, 64))
    regions.append(lanes(blocks[..., so : so + sn], sn))
    pairs = [
        np.concatenate([r[:, b : b + 2].reshape(groups, -1) for r in regions], axis=1)
        for b in range(0, nb, 2)
    ]
    return np.concatenate(pairs, axis=1).reshape(groups * 16, rb)


def unlane_quant_blocks(
    lanes: np.ndarray, dtype: str, rows: int, fifth: str = "masks"
) -> np.ndarray:
    """The GGUF blocks [rows, row bytes] that lane_quant_blocks laid out as `lanes`."""
    if fifth not in FIFTH_FORMS:
        raise ValueError(f"fifth: {fifth!r} is not one of {FIFTH_FORMS}")
    if dtype in LANE_KQUANTS:
        return unlane_kquant_blocks(lanes, dtype, rows, fifth)
    size, (so, sn), qh, (qo, qn) = LANE_BLOCKS[dtype]
    padded, rb = lanes.shape
    nb, groups = rb // size, padded // 16
    flat = np.ascontiguousarray(lanes).reshape(groups, -1)
    blocks = np.zeros((groups, 16, nb, size), np.uint8)
    widths = [16 * qn] + ([64] if qh is not None else []) + [16 * sn]

    def unlanes(cell: np.ndarray, chunk: int) -> np.ndarray:
        """[G, bytes / chunk * 16 rows * chunk] -> [G, 16 rows, bytes]"""
        return cell.reshape(groups, -1, 16, chunk).transpose(0, 2, 1, 3).reshape(groups, 16, -1)

    at = 0
    for b in range(0, nb, 2):
        m = min(2, nb - b)
        for i in range(m):
            parts = [
                flat[:, at + sum(widths[:r]) * m + i * w : at + sum(widths[:r]) * m + (i + 1) * w]
                for r, w in enumerate(widths)
            ]
            if qn == 32:
                q = unlanes(parts[0], 4) ^ 0x80
                blocks[:, :, b + i, qo : qo + qn][..., _CHUNK_ORDER] = q
            else:
                blocks[:, :, b + i, qo : qo + qn] = unlanes(parts[0], 4)
            if qh is not None:
                if fifth == "bytes":
                    bits = _unpack_fields(unlanes(parts[1], 4), 1).reshape(groups, 16, 32)
                else:
                    bits = np.unpackbits(parts[1].reshape(groups, 8, 8), axis=-1, bitorder="little")
                    bits = bits.reshape(groups, 8, 16, 4).transpose(0, 2, 1, 3)
                    bits = bits.reshape(groups, 16, 32)
                natural = np.zeros_like(bits)
                natural[..., _CHUNK_ORDER] = bits
                blocks[:, :, b + i, qh : qh + 4] = np.packbits(natural, axis=-1, bitorder="little")
            blocks[:, :, b + i, so : so + sn] = unlanes(parts[-1], sn)
        at += m * sum(widths)
    return blocks.reshape(padded, rb)[:rows]


# K-quants the CPU kernels read in row lanes (templates/cpu/linear_lanes_k.h): super-block
# bytes. A cell (16 rows' blocks of one super-block) holds their heads (d, dmin, scales as
# stored), then per 32-element unit the fifth bits (Q5_K) or high bits (Q6_K: two, Q3_K:
# one), then its low bits: nibbles as a Q4_1 block's (low nibble elements 0..15, high
# 16..31), Q3_K's 2-bit fields 4 chunks a byte.
LANE_KQUANTS = {"q4_k": 144, "q5_k": 176, "q6_k": 210, "q3_k": 110}
# every type with a lanes form
LANE_TYPES = (*LANE_BLOCKS, *LANE_KQUANTS)


def _kquant_values(blocks: np.ndarray, dtype: str) -> np.ndarray:
    """Super-blocks [..., bytes] -> their unsigned quant values [..., 8 units, 32]."""
    if dtype == "q6_k":
        ql = blocks[..., :128].reshape(*blocks.shape[:-1], 2, 2, 32)  # [half, v & 1, l]
        qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)  # [half, -, l]
        v = np.arange(4).reshape(4, 1)
        lo = (ql[..., v[:, 0] & 1, :] >> (4 * (v >> 1))) & 15  # [half, v, l]
        hi = (qh >> (2 * v)) & 3
        return (lo | (hi << 4)).reshape(*blocks.shape[:-1], 8, 32).astype(np.uint8)
    if dtype == "q3_k":  # unit j = 4h + k: bits 2k of qs[32h + i], bit j of hmask[i]
        qs = blocks[..., 32:96].reshape(*blocks.shape[:-1], 2, 1, 32)
        k = np.arange(4).reshape(4, 1)
        lo = ((qs >> (2 * k)) & 3).reshape(*blocks.shape[:-1], 8, 32)
        hm = blocks[..., :32].reshape(*blocks.shape[:-1], 1, 32)
        return (lo | (((hm >> np.arange(8).reshape(8, 1)) & 1) << 2)).astype(np.uint8)
    qo = 16 if dtype == "q4_k" else 48
    qs = blocks[..., qo : qo + 128].reshape(*blocks.shape[:-1], 4, 1, 32)
    u = (qs >> (4 * np.arange(2).reshape(2, 1))) & 15  # unit 2p + h: nibble h of qs[32p + i]
    u = u.reshape(*blocks.shape[:-1], 8, 32)
    if dtype == "q5_k":  # fifth bit of unit j, element i: bit j of qh[i]
        qh = blocks[..., 16:48].reshape(*blocks.shape[:-1], 1, 32)
        u = u | (((qh >> np.arange(8).reshape(8, 1)) & 1) << 4)
    return u.astype(np.uint8)


def _kquant_blocks(u: np.ndarray, head: np.ndarray, dtype: str) -> np.ndarray:
    """_kquant_values' inverse: values [..., 8, 32] and the head bytes (Q4_K/Q5_K: d, dmin,
    scales; Q6_K, Q3_K: scales, d) -> super-blocks [..., bytes]."""
    lead = u.shape[:-2]
    if dtype == "q3_k":
        qs = np.zeros((*lead, 2, 32), np.uint8)
        hm = np.zeros((*lead, 32), np.uint8)
        for j in range(8):
            qs[..., j >> 2, :] |= (u[..., j, :] & 3) << (2 * (j & 3))
            hm |= ((u[..., j, :] >> 2) & 1) << j
        return np.concatenate([hm, qs.reshape(*lead, 64), head], axis=-1)
    if dtype == "q6_k":
        u = u.reshape(*lead, 2, 4, 32)  # [half, v, l]
        ql = np.zeros((*lead, 2, 2, 32), np.uint8)
        qh = np.zeros((*lead, 2, 32), np.uint8)
        for v in range(4):
            ql[..., v & 1, :] |= (u[..., v, :] & 15) << (4 * (v >> 1))
            qh |= (u[..., v, :] >> 4) << (2 * v)
        return np.concatenate([ql.reshape(*lead, 128), qh.reshape(*lead, 64), head], axis=-1)
    qs = (u[..., 0::2, :] & 15) | ((u[..., 1::2, :] & 15) << 4)  # [..., 4, 32]
    parts = [head[..., :16]]
    if dtype == "q5_k":
        qh = np.zeros((*lead, 32), np.uint8)
        for j in range(8):
            qh |= ((u[..., j, :] >> 4) & 1) << j
        parts.append(qh)
    return np.concatenate([*parts, qs.reshape(*lead, 128)], axis=-1)


def _cell_head(dtype: str) -> list[tuple[str, int]]:
    """A cell's head regions in order, (name, bytes); the units follow, each its fifth bits
    (Q5_K) or high bits (Q6_K, Q3_K), then its low bits (nibbles; Q3_K: 2-bit fields)."""
    if dtype == "q6_k":
        return [("d", 32), ("scales", 256)]
    if dtype == "q3_k":
        return [("d", 32), ("scales", 192)]
    return [("d", 32), ("dmin", 32), ("scales", 192)]


# per unit of a cell: bytes before its low bits
_UNIT_MID = {"q4_k": 0, "q5_k": 64, "q6_k": 128, "q3_k": 64}


def _pack_fields(v: np.ndarray, bits: int) -> np.ndarray:
    """Fields [..., 8 chunks, 4] of `bits` bits -> bytes [..., 8 // (8 // bits) * 4]: byte
    4g + i holds element i of chunks g * n .. g * n + n - 1 (n = 8 // bits) at bits
    `bits` * (chunk % n)."""
    n = 8 // bits
    v = v.reshape(*v.shape[:-2], 8 // n, n, 4).astype(np.uint8)
    shift = (bits * np.arange(n)).reshape(n, 1).astype(np.uint8)
    return (v << shift).sum(axis=-2, dtype=np.uint8).reshape(*v.shape[:-3], -1)


def _unpack_fields(b: np.ndarray, bits: int) -> np.ndarray:
    """_pack_fields' inverse: bytes [..., m] -> fields [..., 8 chunks, 4]."""
    n = 8 // bits
    b = b.reshape(*b.shape[:-1], 8 // n, 1, 4)
    shift = (bits * np.arange(n)).reshape(n, 1).astype(np.uint8)
    return ((b >> shift) & ((1 << bits) - 1)).reshape(*b.shape[:-3], 8, 4)


def lane_kquant_blocks(stored: np.ndarray, dtype: str, fifth: str = "masks") -> np.ndarray:
    """GGUF super-blocks [rows, row bytes] -> the K-quant lanes layout (linear_lanes_k.h):
    rows in groups of 16 (padded with zero blocks), one cell per group and super-block
    (Q5_K's fifth bits as `fifth` of FIFTH_FORMS). Same bytes a row."""
    size = LANE_KQUANTS[dtype]
    rows, rb = stored.shape
    nsb, groups = rb // size, -(-rows // 16)
    blocks = np.zeros((groups * 16, nsb, size), np.uint8)
    blocks[:rows] = np.ascontiguousarray(stored).reshape(rows, nsb, size)
    blocks = blocks.reshape(groups, 16, nsb, size).transpose(0, 2, 1, 3)  # [G, nsb, row, bytes]
    u = _kquant_values(blocks, dtype)  # [G, nsb, row, unit, 32]

    def dwords(a: np.ndarray) -> np.ndarray:
        """[G, nsb, row, bytes] -> [G, nsb, bytes/4 vectors, row, 4]: dword r = row r"""
        return a.reshape(*a.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)

    def unit_vectors(a: np.ndarray) -> np.ndarray:
        """[G, nsb, row, unit, bytes] -> [G, nsb, unit, bytes/4 vectors, row, 4]"""
        return a.reshape(*a.shape[:4], -1, 4).transpose(0, 1, 3, 4, 2, 5)

    chunks = u[..., _CHUNK_ORDER].reshape(*u.shape[:-1], 8, 4)  # [..., unit, chunk, i]
    region = {}
    if dtype == "q6_k":
        region["d"] = blocks[..., 208:210]
        region["scales"] = dwords(blocks[..., 192:208])
        region["high"] = unit_vectors(_pack_fields(chunks >> 4, 2))
    elif dtype == "q3_k":
        region["d"] = blocks[..., 108:110]
        region["scales"] = dwords(blocks[..., 96:108])
        region["high"] = unit_vectors(_pack_fields((chunks >> 2) & 1, 1))
    else:
        region["d"], region["dmin"] = blocks[..., 0:2], blocks[..., 2:4]
        region["scales"] = dwords(blocks[..., 4:16])
        if dtype == "q5_k" and fifth == "bytes":  # byte 4r + i, bit k: row r's chunk k, i
            region["fifth"] = unit_vectors(_pack_fields((chunks >> 4) & 1, 1))
        elif dtype == "q5_k":  # qword k, bit 4r + i: row r's element chunk k, i
            bits = ((chunks >> 4) & 1).transpose(0, 1, 3, 4, 2, 5)  # [G, nsb, unit, k, row, i]
            region["fifth"] = np.packbits(
                bits.reshape(*bits.shape[:4], 64), axis=-1, bitorder="little"
            )
    if dtype == "q3_k":
        low = _pack_fields(chunks & 3, 2)  # [G, nsb, row, unit, 8]
    else:
        low = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)  # [G, nsb, row, unit, 16]
    units = [region[m].reshape(groups, nsb, 8, -1) for m in ("fifth", "high") if m in region]
    units.append(unit_vectors(low).reshape(groups, nsb, 8, -1))
    head = [region[name].reshape(groups, nsb, -1) for name, _ in _cell_head(dtype)]
    cell = np.concatenate([*head, np.concatenate(units, axis=-1).reshape(groups, nsb, -1)], axis=-1)
    return cell.reshape(groups * 16, rb)


def unlane_kquant_blocks(
    lanes: np.ndarray, dtype: str, rows: int, fifth: str = "masks"
) -> np.ndarray:
    """The GGUF super-blocks [rows, row bytes] that lane_kquant_blocks laid out as `lanes`."""
    size = LANE_KQUANTS[dtype]
    padded, rb = lanes.shape
    nsb, groups = rb // size, padded // 16
    cell = np.ascontiguousarray(lanes).reshape(groups, nsb, 16 * size)
    region, at = {}, 0
    for name, n in _cell_head(dtype):
        region[name] = cell[..., at : at + n]
        at += n
    units = cell[..., at:].reshape(groups, nsb, 8, -1)
    mid = _UNIT_MID[dtype]
    region["mid"], region["low"] = units[..., :mid], units[..., mid:]

    def rows_of(a: np.ndarray) -> np.ndarray:
        """[G, nsb, vectors * 64] -> [G, nsb, row, vectors * 4]"""
        return (
            a.reshape(groups, nsb, -1, 16, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nsb, 16, -1)
        )

    def unit_rows(a: np.ndarray) -> np.ndarray:
        """[G, nsb, 8 units, vectors * 64] -> [G, nsb, row, unit, vectors * 4]"""
        return (
            a.reshape(groups, nsb, 8, -1, 16, 4)
            .transpose(0, 1, 4, 2, 3, 5)
            .reshape(groups, nsb, 16, 8, -1)
        )

    low = unit_rows(region["low"])  # [G, nsb, row, unit, 16] (Q3_K: 8)

    def natural(fields: np.ndarray) -> np.ndarray:
        """[..., 8 chunks, 4] -> [..., 32] in element order"""
        out = np.zeros((*fields.shape[:-2], 32), np.uint8)
        out[..., _CHUNK_ORDER] = fields.reshape(*fields.shape[:-2], 32)
        return out

    if dtype == "q3_k":
        u = natural(_unpack_fields(low, 2)) | (
            natural(_unpack_fields(unit_rows(region["mid"]), 1)) << 2
        )
        head = np.concatenate(
            [rows_of(region["scales"]), region["d"].reshape(groups, nsb, 16, 2)], axis=-1
        )
        blocks = _kquant_blocks(u, head, dtype)
        return blocks.transpose(0, 2, 1, 3).reshape(padded, rb)[:rows]
    u = np.concatenate([low & 15, low >> 4], axis=-1)  # element order
    high = np.zeros_like(u)
    if dtype == "q6_k":
        high = natural(_unpack_fields(unit_rows(region["mid"]), 2))
        head = np.concatenate(
            [rows_of(region["scales"]), region["d"].reshape(groups, nsb, 16, 2)], axis=-1
        )
    else:
        if dtype == "q5_k" and fifth == "bytes":
            high = natural(_unpack_fields(unit_rows(region["mid"]), 1))
        elif dtype == "q5_k":
            bits = np.unpackbits(
                region["mid"].reshape(groups, nsb, 8, 8, 8), axis=-1, bitorder="little"
            )
            bits = bits.reshape(groups, nsb, 8, 8, 16, 4).transpose(
                0, 1, 4, 2, 3, 5
            )  # [row, unit, k, i]
            high[..., _CHUNK_ORDER] = bits.reshape(groups, nsb, 16, 8, 32)
        dm = [region[f].reshape(groups, nsb, 16, 2) for f in ("d", "dmin")]
        head = np.concatenate([*dm, rows_of(region["scales"])], axis=-1)
    blocks = _kquant_blocks(u | (high << 4), head, dtype)  # [G, nsb, row, bytes]
    return blocks.transpose(0, 2, 1, 3).reshape(padded, rb)[:rows]
