"""The gated delta rule (Gated DeltaNet's linear attention) in two forms that give the same
numbers: a loop over tokens, and chunks of tokens as a few matrix products.

Per value head, with a state S [dk, dv] and per token t a decay a_t = exp(g_t), a rate
beta_t, a key k_t, a value v_t and a query q_t (already scaled):

    S'   = a_t S                                  decay
    u_t  = beta_t (v_t - S'^T k_t)                the part of v_t S' does not predict
    S    = S' + k_t u_t^T                         write it
    o_t  = S^T q_t                                read

Chunked: inside a chunk of L tokens starting from S0, with G_t = g_1 + ... + g_t,
S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T, so the u_t solve one unit lower-
triangular system  (I + A) U = diag(beta) V - diag(beta e^G) K S0  with
A[t, s] = beta_t e^{G_t - G_s} k_t.k_s (s < t), and then

    O   = diag(e^G) Q S0 + (mask(e^{G_t - G_s}) * Q K^T) U        (s <= t)
    S_L = e^{G_L} S0 + K^T diag(e^{G_L - G}) U

The loop runs L steps of matrix-vector work; the chunk does L x L and L x d products, which
is what a prefill kernel wants. Both work in the arrays' dtype.
"""

from __future__ import annotations

import numpy as np


def expand_heads(x: np.ndarray, heads: int, tiled: bool) -> np.ndarray:
    """Key-head tensors [T, Hk, d] -> one per value head [T, Hv, d]: value head h reads key
    head h // (Hv / Hk) (HF's grouped order) or h % Hk (llama.cpp's tiled order)."""
    ratio = heads // x.shape[1]
    return np.tile(x, (1, ratio, 1)) if tiled else np.repeat(x, ratio, axis=1)


def recurrent(q, k, v, g, beta, state):
    """Token by token. q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state [H, dk, dv]
    (value heads already expanded). Returns (o [T, H, dv], the final state)."""
    S = state.copy()
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", S, k[t])
        u = beta[t][:, None] * (v[t] - predicted)
        S += k[t][:, :, None] * u[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same in chunks of `chunk` tokens (the last one shorter)."""
    S = state.copy()
    out = np.empty_like(v)
    for start in range(0, q.shape[0], chunk):
        sl = slice(start, min(start + chunk, q.shape[0]))
        out[sl], S = _chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], S)
    return out, S


def _chunk(q, k, v, g, beta, S0):
    # heads first: [H, L, d]
    q, k, v = (np.swapaxes(x, 0, 1) for x in (q, k, v))
    g, beta = g.T, beta.T  # [H, L]
    L = q.shape[1]
    G = np.cumsum(g, axis=1)
    diff = G[:, :, None] - G[:, None, :]  # [H, t, s]: G_t - G_s
    below = np.tril(np.ones((L, L), dtype=bool))
    # NOTE: masked before exp so the s > t entries (positive exponents) never overflow.
    decay = np.exp(np.where(below, diff, -np.inf))
    kk = k @ np.swapaxes(k, 1, 2)
    A = beta[:, :, None] * decay * kk
    A[:, np.arange(L), np.arange(L)] = 0.0
    system = A + np.eye(L, dtype=q.dtype)
    eG = np.exp(G)
    rhs = beta[:, :, None] * v - (beta * eG)[:, :, None] * (k @ S0)
    U = np.linalg.solve(system, rhs)
    out = eG[:, :, None] * (q @ S0) + (decay * (q @ np.swapaxes(k, 1, 2))) @ U
    tail = np.exp(G[:, -1:] - G)  # [H, L]: e^{G_L - G_s}
    S = np.exp(G[:, -1])[:, None, None] * S0 + np.swapaxes(k * tail[:, :, None], 1, 2) @ U
    return np.swapaxes(out, 0, 1).astype(v.dtype), S.astype(S0.dtype)
