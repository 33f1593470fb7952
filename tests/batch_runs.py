"""Driving a BatchEngine in tests (tests/runtime/test_batch*.py): greedy sequences joining
and leaving at given steps, and the pool's state after them."""

from __future__ import annotations

import numpy as np

from hipc.runtime.batch import BatchEngine


def run(be: BatchEngine, joins: list[int], new: list[int], prompts, leave=None):
    """Greedy decoding: sequence i joins at step joins[i] (None: never) and leaves after
    new[i] tokens, or when `leave(i, step)` says so. Returns {i: (tokens, logits)}."""
    out: dict[int, tuple[list[int], list[np.ndarray]]] = {}
    seqs, step = {}, 0
    while True:
        for i, j in enumerate(joins):
            if j is not None and j <= step and i not in seqs:
                s = be.admit(prompts[i], len(prompts[i]) + new[i])
                if s is not None:
                    seqs[i], out[i] = s, ([], [])
        if len(seqs) == sum(j is not None for j in joins) and not be.running:
            return out
        logits = be.step()
        step += 1
        for i, s in seqs.items():
            if leave is not None and s in be.running and leave(i, step):
                be.release(s)
            if s not in logits or s not in be.running:
                continue
            token = int(np.argmax(logits[s]))
            out[i][0].append(token)
            out[i][1].append(logits[s].copy())
            if len(out[i][0]) >= new[i]:
                be.release(s)
            else:
                be.feed(s, token)


def run_overlapped(be: BatchEngine, picks, new: list[int], prompts, fed_past=()):
    """Greedy decoding as the server's loop runs it on a backend that `overlaps`: each step's
    tokens are fed and the next step submitted before the ended sequences are released.
    Sequences `picks` start together; those in `fed_past` are fed their last token too (as
    when a stop string ends a sequence after the next step started: a wasted row). Checks
    that a sequence released while a step with a row of it is in flight keeps its blocks
    until then. Returns
    {i: (tokens, logits)}."""
    assert be.overlaps
    seqs = {i: be.admit(prompts[i], len(prompts[i]) + new[i]) for i in picks}
    got = {i: ([], []) for i in picks}
    assert be.submit()
    while be.in_flight:
        out = be.collect()
        ending, fed = [], set()
        for s, row in zip(out.seqs, out.logits, strict=True):
            i = next(k for k, v in seqs.items() if v is s)
            if len(got[i][0]) >= new[i]:
                continue  # the wasted row of a sequence that already ended
            token = int(np.argmax(row))
            got[i][0].append(token)
            got[i][1].append(row.copy())
            if len(got[i][0]) < new[i] or i in fed_past:
                be.feed(s, token)
                fed.add(s)
            if len(got[i][0]) == new[i]:
                ending.append(s)
        stepping = be.submit()
        for s in ending:
            held = be.pool.free
            be.release(s)
            if stepping and s in fed:
                # a row of the step just submitted: its blocks may still be written
                assert be.pool.free == held
    return got


def assert_pool_full(be: BatchEngine):
    assert be.pool.free == be.pool.n_blocks and be.pool.reserved == 0
    assert not any(be.pool.refs) and not be.running


def alone(engine, i: int, prompts, new, max_batch: int = 4):
    """Sequence i run by itself through a BatchEngine of its own."""
    joins = [None] * len(prompts)
    joins[i] = 0
    return run(BatchEngine(engine, max_batch=max_batch), joins, new, prompts)[i]


def run_pipelined(be: BatchEngine, picks, new: list[int], prompts, top: int = 1):
    """Greedy decoding as the server's loop runs it where steps go ahead: before each step is
    collected the next one is submitted, its decode rows fed on the device from the first
    one's picks (top-1 of `top`); the host then feeds each sequence the same token and releases the
    ended ones, whose rows in the step ahead are wasted. Returns ({i: tokens}, the number of
    steps submitted ahead)."""
    assert be.pipelines
    seqs = {i: be.admit(prompts[i], len(prompts[i]) + new[i]) for i in picks}
    got: dict[int, list[int]] = {i: [] for i in picks}
    ahead = 0
    assert be.submit(top)
    while be.in_flight:
        if be.can_submit_ahead and be.running:
            ahead += be.submit(top, ahead=True)
        out = be.collect()
        # (a step of prompt chunks only returns no rows)
        for s, ids in zip(out.seqs, out.top_ids if out.seqs else [], strict=True):
            i = next(k for k, v in seqs.items() if v is s)
            if len(got[i]) >= new[i]:
                continue  # the wasted row of a sequence that already ended
            got[i].append(int(ids[0]))
            if len(got[i]) < new[i]:
                be.feed(s, int(ids[0]))
            else:
                held = be.pool.free
                be.release(s)
                if be.in_flight and s.last_step >= be.steps - 1:
                    assert be.pool.free == held  # a row of the step ahead may write them
        if not be.in_flight and be.running:
            be.submit(top)
    return got, ahead
