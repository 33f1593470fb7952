"""NumPy reference implementations, one per op, keyed like the type rules.

These define what an op means. They favour clarity over speed: the compiled
kernels are checked against them, never the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hipc.compiler.ir import Node
from hipc.compiler.reference import delta_rule
from hipc.compiler.reference.topk import topk_torch_cpu

Impl = Callable[[Node, Sequence[np.ndarray], Any], list[np.ndarray]]
IMPLS: dict[str, Impl] = {}


def impl(*ops: str) -> Callable[[Impl], Impl]:
    def register(fn: Impl) -> Impl:
        for op in ops:
            IMPLS[op] = fn
        return fn

    return register


@impl("Add")
def _add(node, ins, ctx):
    return [ins[0] + ins[1]]


@impl("Mul")
def _mul(node, ins, ctx):
    return [ins[0] * ins[1]]


@impl("Div")
def _div(node, ins, ctx):
    return [ins[0] / ins[1]]


@impl("Tanh")
def _tanh(node, ins, ctx):
    return [np.tanh(ins[0])]


@impl("Gelu")
def _gelu(node, ins, ctx):
    x = ins[0]
    if node.attrs.get("approximate", "none") == "tanh":
        # transformers' gelu_pytorch_tanh (Gemma's GeGLU)
        inner = np.sqrt(2.0 / np.pi).astype(x.dtype) * (x + x.dtype.type(0.044715) * x**3)
        return [(0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype)]
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return [(0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype)]


@impl("hipc::SoftCap")
def _softcap(node, ins, ctx):
    cap = ins[0].dtype.type(node.attrs["cap"])
    return [np.tanh(ins[0] / cap) * cap]


@impl("Sigmoid")
def _sigmoid(node, ins, ctx):
    x = ins[0]
    # NOTE: split by sign so exp never overflows.
    e = np.exp(-np.abs(x))
    return [np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)]


@impl("Exp")
def _exp(node, ins, ctx):
    return [np.exp(ins[0])]


@impl("Neg")
def _neg(node, ins, ctx):
    return [-ins[0]]


@impl("Softplus")
def _softplus(node, ins, ctx):
    # log(1 + e^x) without overflow (torch's threshold of 20 returns x there: the same
    # number to float32 precision)
    return [np.logaddexp(ins[0].dtype.type(0), ins[0])]


@impl("Concat")
def _concat(node, ins, ctx):
    return [np.concatenate(ins, axis=-1)]


@impl("hipc::CausalConv1d")
def _causal_conv1d(node, ins, ctx):
    x, w, state = ins
    w = w.reshape(w.shape[0], w.shape[-1])
    K = w.shape[1]
    window = np.concatenate([state.astype(x.dtype), x], axis=0)  # [K - 1 + T, C]
    T = x.shape[0]
    y = np.zeros_like(x)
    for j in range(K):
        y += window[j : j + T] * w[:, j].astype(x.dtype)
    state[...] = window[T:]
    return [y]


@impl("hipc::L2Normalization")
def _l2_norm(node, ins, ctx):
    x = ins[0]
    eps = x.dtype.type(node.attrs["epsilon"])
    return [x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)]


@impl("hipc::GatedDeltaRule")
def _gated_delta_rule(node, ins, ctx):
    """One token: the recurrence; several: the chunked form (delta_rule.py), as the
    model's own code runs decode and prefill."""
    q, k, v, g, beta, state = ins
    tiled = bool(node.attrs.get("v_tiled"))
    heads = v.shape[1]
    q = delta_rule.expand_heads(q, heads, tiled) * q.dtype.type(node.attrs["scale"])
    k = delta_rule.expand_heads(k, heads, tiled)
    chunk = int(node.attrs.get("chunk_size", 0))
    if chunk and q.shape[0] > 1:
        out, final = delta_rule.chunked(q, k, v, g, beta, state.astype(v.dtype), chunk)
    else:
        out, final = delta_rule.recurrent(q, k, v, g, beta, state.astype(v.dtype))
    state[...] = final
    return [out]


@impl("Clip")
def _clip(node, ins, ctx):
    x, lo, hi = ins
    return [np.clip(x, lo.astype(x.dtype), hi.astype(x.dtype))]


@impl("Cast")
def _cast(node, ins, ctx):
    # bf16 weights arrive widened to float32 (exact); float16 converts exactly too.
    return [ins[0].astype(ctx.float_dtype)]


@impl("hipc::Dequantize")
def _dequantize(node, ins, ctx):
    return [ins[0].astype(ctx.float_dtype)]


@impl("Transpose")
def _transpose(node, ins, ctx):
    return [np.ascontiguousarray(np.transpose(ins[0], node.attrs.get("perm")))]


@impl("Gather")
def _gather(node, ins, ctx):
    return [np.take(ins[0], ins[1], axis=0)]


@impl("RMSNormalization")
def _rms_norm(node, ins, ctx):
    x, scale = ins
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return [x / np.sqrt(ms + node.attrs["epsilon"]) * scale]


@impl("MatMul")
def _matmul(node, ins, ctx):
    return [ins[0] @ ins[1]]


@impl("Reshape")
def _reshape(node, ins, ctx):
    shape = [ins[0].shape[i] if d == 0 else int(d) for i, d in enumerate(ins[1])]
    return [ins[0].reshape(shape)]


@impl("RotaryEmbedding")
def _rope(node, ins, ctx):
    x, cos_cache, sin_cache, pos = ins
    rot = node.attrs.get("rotary_embedding_dim") or x.shape[-1]
    cos = cos_cache[pos][:, None, :].astype(x.dtype)  # [tokens, 1, rot/2]
    sin = sin_cache[pos][:, None, :].astype(x.dtype)
    xr, rest = x[..., :rot], x[..., rot:]
    if node.attrs.get("interleaved"):
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = np.empty_like(xr)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x2 * cos + x1 * sin
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return [np.concatenate([out, rest], axis=-1)]


@impl("hipc::CachedAttention")
def _cached_attention(node, ins, ctx):
    """Write k, v at `positions` into the caches, then causal attention over the cache.

    Query i (at position p_i) sees cached keys at positions <= p_i, and with a
    sliding window W only those > p_i - W. A `softcap` attribute caps the scaled scores. Grouped-query: query head h reads KV head
    h // (heads / kv_heads).
    """
    q, k, v, pos, k_cache, v_cache = ins
    k_cache[pos] = ctx.store_kv(k)
    v_cache[pos] = ctx.store_kv(v)
    n_ctx = int(pos.max()) + 1
    keys, vals = k_cache[:n_ctx], v_cache[:n_ctx]  # [ctx, kv, d]
    group = q.shape[1] // k.shape[1]
    keys = np.repeat(keys, group, axis=1)
    vals = np.repeat(vals, group, axis=1)
    scores = np.einsum("thd,chd->htc", q, keys) * node.attrs["scale"]
    cap = node.attrs.get("softcap") or 0.0
    if cap:  # Gemma-2: scores -> cap * tanh(scores / cap), before the mask
        scores = np.tanh(scores / cap) * cap
    key_pos = np.arange(n_ctx)
    visible = key_pos[None, :] <= pos[:, None]
    window = node.attrs.get("sliding_window") or 0
    if window:
        visible &= key_pos[None, :] > pos[:, None] - window
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return [np.einsum("htc,chd->thd", p, vals).astype(q.dtype)]


@impl("hipc::MoERouter")
def _moe_router(node, ins, ctx):
    """Softmax over all experts, the top_k largest, optionally renormalised to sum 1.

    Rows whose top-k set or order holds a tie take torch's CPU tie order (topk.py); the
    others have one answer, found by a sort.
    """
    logits = ins[0]
    k = node.attrs["top_k"]
    z = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    ids = order[:, :k].copy()
    head = np.take_along_axis(probs, order[:, : k + 1], axis=-1)
    for t in np.nonzero((np.diff(head, axis=-1) == 0).any(axis=-1))[0]:
        ids[t] = topk_torch_cpu(probs[t].tolist(), k)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if node.attrs.get("normalize"):
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return [ids.astype(np.int64), weights.astype(logits.dtype)]


@impl("hipc::Experts")
def _experts(node, ins, ctx):
    """Each token through its routed experts' SwiGLU MLPs, summed with the router weights."""
    x, ids, weights, *w = ins
    if len(w) == 3:
        gate, up, down = w
    else:
        gate_up, down = w
        F = down.shape[2]
        gate, up = gate_up[:, :F], gate_up[:, F:]
    out = np.zeros_like(x)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        h = x[tok]
        g = h @ gate[e].T.astype(x.dtype, copy=False)
        u = h @ up[e].T.astype(x.dtype, copy=False)
        act = g * _sigmoid(node, [g], ctx)[0] * u
        y = act @ down[e].T.astype(x.dtype, copy=False)
        np.add.at(out, tok, y * weights[tok, slot, None].astype(x.dtype))
    return [out]


@impl("hipc::Linear")
def _linear(node, ins, ctx):
    y = ins[0] @ ins[1].T.astype(ins[0].dtype, copy=False)
    return [y + ins[2] if len(ins) > 2 else y]


@impl("hipc::SiLU")
def _silu(node, ins, ctx):
    return [ins[0] * _sigmoid(node, ins, ctx)[0]]


@impl("Split")
def _split(node, ins, ctx):
    bounds = np.cumsum(node.attrs["split"])[:-1]
    return list(np.split(ins[0], bounds, axis=-1))


@impl("hipc::Embedding")
def _embedding(node, ins, ctx):
    return [np.take(ins[0], ins[1], axis=0).astype(ctx.float_dtype)]
