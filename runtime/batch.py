"""Continuous batching: one step advances every running sequence.

`BatchEngine` wraps a compiled engine whose backend can step rows of many sequences (the cpu
and GPU backends' `step`: per-row positions, block tables over paged KV pools). Sequences join with
`admit()` and leave with `release()` between steps; each `step()` runs, in one call:

- one row per decoding sequence (its last sampled token), then
- a chunk of each prefilling sequence's prompt, in admission order, while the step has rows
  left (`prefill_chunk` per sequence at most): a long prompt is spread over several steps
  and the decoding sequences keep advancing meanwhile.

It returns the logits of every sequence whose pending tokens are all computed; the caller
samples (each sequence with its own Decoding: sampler, seed, stops, logprobs) and `feed()`s
the next token. A step is `submit()` then `collect()`: on a backend that `overlaps` (a
GPU's submit_step) submit returns at once, so the caller can feed the tokens it has just
picked, submit the next step and do the rest of the host work (detokenizing, stops,
streaming) while the device computes; sequences released meanwhile keep their blocks until
the steps in flight with rows of them are collected. Where the backend `pipelines` and the
step in flight picks its tokens on the device, `submit(top, ahead=True)` queues the next
one before that step is collected, its decode rows' ids copied on the device from that
step's picks; the host feeds each sequence the same token when it collects the step.
`run_step(top=k)` returns them as one [rows, vocab] array, or, from a backend that picks
tokens on the device (`step_top`, `max_top_k` >= k), each row's k likeliest ids and logits:
what an all-greedy batch needs, rows x k values instead of rows x vocab. Blocks come from a KVPool: a sequence is admitted only when every block it
may need can be promised (prompt + max_tokens), and the full blocks of its prompt that an
earlier sequence computed are shared instead of recomputed (prefix caching by block hash).

Recurrent states (hybrid models' linear-attention layers) live in the backend's slots, one
per batch slot (the sequence's row of the block tables): zeroed when a sequence starts there.
They follow their kind's rule for prefix reuse: shared KV blocks are usable only up to a
prefix end where a snapshot of the recurrent states was kept. Snapshots are taken at every
multiple of `snapshot_every` positions (SNAPSHOT_INTERVAL on the CPU, the prefill chunk on
GPUs) and at the end of a prompt's last full block (where
the same prompt again, the n choices of a request, can resume), keyed by the block hash of
that prefix; a prefill chunk ends at each such point so the states are there to copy.

Engines without a batched backend (the reference executor) are not wrapped: the server runs
them one sequence at a time (runtime/server/runner.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from hipc.base.errors import HipcError
from hipc.runtime.kv_pool import KVPool, block_hashes
from hipc.runtime.recurrent import MAX_SNAPSHOTS, SNAPSHOT_INTERVAL, release_snapshot


@dataclass
class StepOut:
    """What one step gives the sampler: per finished row, in row order, its sequence and
    either its logits ([rows, vocab]) or, picked on the device, its top token ids and their
    logits ([rows, k], most likely first, ties by lower id: argmax's pick first)."""

    seqs: list[Sequence]
    logits: np.ndarray | None
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None


@dataclass(eq=False)
class Sequence:
    """One sequence in the batch: its tokens (prompt, then each fed token) and its blocks."""

    id: int
    tokens: list[int]
    prompt_len: int
    slot: int  # its row of the block tables
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in the pool
    cached: int = 0  # prompt positions found in the prefix cache
    quota: int = 0  # blocks promised and not allocated yet
    hashes: list[bytes] = field(default_factory=list)  # of its full prompt blocks
    published: int = 0  # its blocks offered to the prefix cache
    last_step: int = -1  # the last step with a row of it (its blocks in use until collected)

    @property
    def pending(self) -> int:
        """Tokens known and not computed yet: -1 while a step ahead computes a token the
        device picked and the host has not been fed yet."""
        return len(self.tokens) - self.computed


def batchable(engine) -> bool:
    """Whether the engine's backend steps rows of many sequences over a paged KV pool, with
    a slot of every recurrent state per sequence where the model has them (the cpu and GPU
    backends)."""
    backend = getattr(engine, "backend", None)
    if not callable(getattr(backend, "step", None)):
        return False
    return getattr(engine, "prefix_reuse", True) or callable(getattr(backend, "ensure_slots", None))


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(row, source) pairs, rows ascending, as runs (row, source, count) of consecutive rows
    from consecutive sources: one device copy each."""
    runs: list[list[int]] = []
    for row, src in pairs:
        if runs and runs[-1][0] + runs[-1][2] == row and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([row, src, 1])
    return [(r, s, n) for r, s, n in runs]


class BatchEngine:
    def __init__(self, engine, max_batch: int = 8, prefill_chunk: int | None = None) -> None:
        if not batchable(engine):
            raise HipcError(f"the {engine.backend.name} backend runs one sequence at a time")
        self.engine = engine
        self.backend = backend = engine.backend
        self.max_context = engine.max_context
        self.vocab_size = engine.vocab_size
        self.step_rows = backend.max_tokens
        self.prefill_chunk = min(prefill_chunk or self.step_rows, self.step_rows)
        if max_batch < 1:
            raise HipcError(f"--max-batch {max_batch}: at least 1")
        # every decoding sequence takes a row of each step, and a step holds step_rows rows
        self.max_batch = min(max_batch, self.step_rows)
        step_top = getattr(backend, "step_top", None)
        self._step_top = step_top if callable(step_top) else None
        self.block = backend.kv_block
        self.pool = KVPool(backend.kv_blocks, self.block)
        # recurrent states: a backend slot per batch slot, reusable only from a snapshot (the
        # state-kind rule); prefix hash at the snapshot's position -> the states there
        self.recurrent = not engine.prefix_reuse
        if self.recurrent:
            backend.ensure_slots(self.max_batch)
        self.snapshots: OrderedDict[bytes, object] = OrderedDict()
        # a step ends at every snapshot mark, so on a GPU (a step of max_tokens rows costs
        # little more than one of 64) marks as far apart as the prefill chunk: a long prompt
        # then prefills in whole chunks; prefix reuse still ends at each prompt's last block
        self.snapshot_every = (
            SNAPSHOT_INTERVAL
            if backend.name == "cpu"
            else max(SNAPSHOT_INTERVAL, self.prefill_chunk // SNAPSHOT_INTERVAL * SNAPSHOT_INTERVAL)
        )
        self.max_snapshots = MAX_SNAPSHOTS
        self.tables = np.zeros((self.max_batch, backend.kv_table), np.int32)
        self._slots = list(range(self.max_batch))
        self._ids = itertools.count()
        self.running: list[Sequence] = []
        # hashes of prompt blocks that running prefills will publish: a sequence sharing
        # them waits for them rather than computing them again (the n choices of a request)
        self._coming: dict[bytes, Sequence] = {}
        self.steps = 0
        self.last_batch = 0
        submit_step = getattr(backend, "submit_step", None)
        self._submit_step = (
            submit_step
            if callable(submit_step) and callable(getattr(backend, "collect", None))
            else None
        )
        # submitted and not collected, oldest first, with their step numbers: one step, or
        # two where one was submitted `ahead` (its decode rows fed on the device)
        self._in_flight: deque[tuple[int, StepOut | tuple]] = deque()
        self._collected = 0  # steps collected: a row of step k is done once k < this
        self._released: list[Sequence] = []  # released while a step with a row of it ran

    # -------------------------------------------------------------- admission

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def fits_ever(self, positions: int) -> bool:
        """Whether a sequence of `positions` could be admitted into an empty pool."""
        return self.blocks_for(positions) <= self.pool.n_blocks

    def admit(self, prompt: Seq[int], max_positions: int) -> Sequence | None:
        """Start a sequence, or None if it must wait: no free batch slot, its blocks cannot
        all be promised, or a running prefill is computing its prompt's next block.
        `max_positions`: the most positions it may ever hold (prompt + max_tokens)."""
        if not self._slots:
            return None
        prompt = [int(t) for t in prompt]
        if not prompt or len(prompt) > max_positions or max_positions > self.max_context:
            raise HipcError(f"a sequence of {len(prompt)}..{max_positions} positions does not fit")
        hashes = block_hashes(prompt, self.block) if self.pool.caching else []
        # the last prompt token is always computed (its logits are needed), so a block
        # holding it is never shared
        shareable = hashes[: (len(prompt) - 1) // self.block]
        hits = self.pool.lookup(shareable)
        if self.recurrent:
            # KV blocks only up to the longest prefix whose recurrent states were kept; wait
            # for a running prefill that will keep them further along this prompt
            n = len(hits)
            while n and hashes[n - 1] not in self.snapshots:
                n -= 1
            hits = hits[:n]
            if any(h in self._coming for h in shareable[n:]):
                return None
        elif len(hits) < len(shareable) and shareable[len(hits)] in self._coming:
            return None
        need = self.blocks_for(max_positions)
        if not self.pool.admit(hits, need - len(hits)):
            return None
        slot = self._slots.pop(0)
        seq = Sequence(next(self._ids), prompt, len(prompt), slot, list(hits))
        seq.computed = seq.cached = len(hits) * self.block
        seq.published = len(hits)
        seq.quota = need - len(hits)
        seq.hashes = hashes
        self.pool.queried_tokens += len(prompt)
        self.pool.hit_tokens += seq.cached
        self.tables[slot, : len(hits)] = hits
        if self.recurrent:
            if hits:
                key = hashes[len(hits) - 1]
                self.snapshots.move_to_end(key)
                self.backend.restore(self.snapshots[key], slot)
            else:
                self.backend.reset(slot)
            coming = [p // self.block - 1 for p in self._marks(seq, len(prompt) - 1)]
        else:
            coming = range(len(hits), len(hashes))
        for i in coming:
            self._coming.setdefault(hashes[i], seq)
        self.running.append(seq)
        return seq

    def _marks(self, s: Sequence, upto: int) -> list[int]:
        """The positions past s.computed and up to `upto` where s's recurrent states are kept:
        multiples of snapshot_every, and the end of its prompt's last full block (the last
        prompt token is always computed, so a prompt shares at most that far)."""
        every = self.snapshot_every
        marks = set(range((s.computed // every + 1) * every, upto + 1, every))
        share_end = (s.prompt_len - 1) // self.block * self.block
        if s.computed < share_end <= upto:
            marks.add(share_end)
        return sorted(marks)

    def feed(self, seq: Sequence, token: int) -> None:
        """The token sampled for `seq`: computed (and its logits returned) in the next step,
        or already being computed by a step submitted ahead, which took the device's pick
        (the same token: ahead steps run only when every sequence decodes greedily)."""
        if seq.pending > 0:
            raise HipcError("a sequence was fed before its pending tokens were computed")
        if (
            len(seq.tokens) >= self.max_context
            or len(seq.tokens) >= (len(seq.blocks) + seq.quota) * self.block
        ):
            raise HipcError("a sequence was fed past the positions it was admitted for")
        seq.tokens.append(int(token))
        if seq.pending < 1:
            self._publish(seq)

    def release(self, seq: Sequence) -> None:
        """The sequence has ended or was cancelled: its blocks go back to the pool."""
        if seq not in self.running:
            return
        self.running.remove(seq)
        if seq.last_step >= self._collected:
            # a row of a step in flight may still write its blocks (a token fed before it
            # ended): they go back when that step is collected
            self._released.append(seq)
            return
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        for b in seq.blocks:
            self.pool.release(b)
        self.pool.unreserve(seq.quota)
        seq.blocks, seq.quota = [], 0
        for h in seq.hashes:
            if self._coming.get(h) is seq:
                del self._coming[h]
        self._slots.append(seq.slot)
        self._slots.sort()

    # -------------------------------------------------------------- stepping

    def step(self) -> dict[Sequence, np.ndarray]:
        """Run one step; the logits of each sequence whose tokens are now all computed (valid
        until the next step: a GPU backend returns rows of its pinned buffer)."""
        out = self.run_step()
        return dict(zip(out.seqs, out.logits, strict=True))

    @property
    def tops_on_device(self) -> int:
        """The most top tokens per row the backend can pick on the device (`step_top`),
        0 when it returns logits only."""
        return int(getattr(self.backend, "max_top_k", 0) or 0) if self._step_top else 0

    @property
    def draws_on_device(self) -> int:
        """The most rows a step picked on the device (top 1) draws at a temperature (submit's
        `draw`): the backend's, where steps overlap; 0 where it cannot."""
        return int(getattr(self.backend, "draws_on_device", 0) or 0) if self.overlaps else 0

    @property
    def overlaps(self) -> bool:
        """Whether a step can be in flight while the host works (a backend with
        `submit_step` and `collect`: a GPU's): `submit` then returns at once and the caller
        streams the last step's tokens while the device runs the next. Models with
        recurrent states step synchronously (their snapshots are taken between steps)."""
        return self._submit_step is not None and not self.recurrent

    @property
    def pipelines(self) -> bool:
        """Whether a step may be submitted `ahead` of the one in flight: a backend that feeds
        a step's rows from the last step's device picks (`pipelines`: events and device
        copies). The device then never waits for the host between steps."""
        return self.overlaps and bool(getattr(self.backend, "pipelines", False))

    @property
    def can_submit_ahead(self) -> bool:
        """One step in flight, its tokens picked on the device, and steps ahead possible."""
        if len(self._in_flight) != 1 or not self.pipelines:
            return False
        pending = self._in_flight[0][1]
        return isinstance(pending, tuple) and bool(pending[1])

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    def run_step(self, top: int = 0) -> StepOut:
        """Run one step. The sequences whose tokens are now all computed, in row order, and
        their logits as one [rows, vocab] array (valid until the next step); with `top` k > 0
        and a backend that picks them on the device (`tops_on_device` >= k), their k most
        likely token ids and logits instead: the host then receives rows x k values, not
        rows x vocab."""
        self.submit(top)
        return self.collect()

    def submit(self, top: int = 0, ahead: bool = False, draw=None) -> bool:
        """Start one step (run_step's, without waiting where the backend `overlaps`); False
        when no sequence has a token to compute. Between submit and `collect` sequences may
        be fed (those whose tokens are all queued), admitted and released (their blocks go
        back once the steps in flight with rows of them are collected).

        `ahead` (where `can_submit_ahead`, with `top`): submitted before the step in flight
        is collected. Each sequence that step returns a token for decodes on in this one
        from that token, which the device copies from its own pick (top-1); `collect`
        returns the two in order, and the host feeds each sequence that same token. A
        sequence that the earlier step's token ends has its row here computed for nothing.

        `draw` (with top 1, where the step returns at most `draws_on_device` rows): called
        once for each sequence the step returns a token for, in row order, its
        (1 / temperature, u) (Decoding.draw): 0 for its greedy token, else the token drawn at
        that temperature by u, picked on the device."""
        feed_from = None
        if self._in_flight:
            if not ahead:
                raise HipcError("a step is already in flight: collect() it first")
            if not self.can_submit_ahead or not 0 < top <= self.tops_on_device:
                raise HipcError("a step goes ahead only of one picked on the device, with top")
            feed_from = {s: i for i, s in enumerate(self._in_flight[0][1][0])}
        planned = self._plan(feed_from)
        if planned is None:
            return False
        rows, ids, pos, seq_rows, out_rows, wanted, feed = planned
        args = (ids, pos, seq_rows, self.tables)
        on_device = 0 < top <= self.tops_on_device
        serial = self.steps
        if self.overlaps:
            extra = {"feed": feed} if feed_from is not None else {}
            if draw is not None and wanted and on_device and top == 1:
                # (the backend refuses more rows than draws_on_device)
                extra["draws"] = np.array([draw(s) for s in wanted], np.float32)
            if wanted:
                self._submit_step(*args, out_rows, top if on_device else 0, **extra)
            else:  # the entry point writes at least one row of logits: the last, dropped
                self._submit_step(*args, np.array([len(ids) - 1], np.int32), 0, **extra)
            # (a step of prompt chunks only returns no token: none to feed a step ahead from)
            self._in_flight.append((serial, (wanted, on_device and bool(wanted))))
        elif not wanted:
            out = StepOut([], self._step_without_logits(ids, pos, seq_rows))
            self._in_flight.append((serial, out))
        elif on_device:
            top_ids, top_logits = self._step_top(*args, out_rows, top)
            out = StepOut(wanted, None, np.asarray(top_ids), np.asarray(top_logits))
            self._in_flight.append((serial, out))
        else:
            self._in_flight.append((serial, StepOut(wanted, self.backend.step(*args, out_rows))))
        for s, n in rows:
            s.last_step = serial
            marks = self._marks(s, s.computed + n) if self.recurrent else []
            self._computed(s, s.computed + n)
            if marks and marks[-1] == s.computed:
                self._keep(s)
        self.steps += 1
        self.last_batch = len(rows)
        return True

    def collect(self) -> StepOut:
        """The oldest step in flight (waiting for it where it runs on a device); the
        sequences released meanwhile whose rows it ran last give their blocks back now.
        Empty when none is in flight."""
        if not self._in_flight:
            return StepOut([], np.empty((0, self.vocab_size), np.float32))
        serial, pending = self._in_flight.popleft()
        done = serial + 1
        try:
            if isinstance(pending, StepOut):
                return pending
            wanted, on_device = pending
            if on_device:
                top = self.backend.collect()
                return StepOut(wanted, None, np.asarray(top[0]), np.asarray(top[1]))
            logits = self.backend.collect(copy=False)
            if not wanted:
                return StepOut([], np.empty((0, self.vocab_size), np.float32))
            return StepOut(wanted, logits)
        except BaseException:
            # a failed step leaves nothing in flight on the backend: a step ahead of it is
            # gone too
            self._in_flight.clear()
            done = self.steps
            raise
        finally:
            self._collected = done
            keep = []
            for seq in self._released:
                if seq.last_step < done:
                    self._free(seq)
                else:
                    keep.append(seq)
            self._released = keep

    def _plan(self, feed_from: dict[Sequence, int] | None = None) -> tuple | None:
        """The next step's rows: (rows as (sequence, tokens), ids, positions, sequence rows,
        out rows, the sequences whose logits it returns, feed runs), blocks grown for them;
        None when no sequence has a token to compute. `feed_from` (a step ahead): the step in
        flight's returned sequences by out row; those with no token left to compute decode
        on from its pick, their ids copied on the device: the feed runs (row, out row, count)."""
        rows: list[tuple[Sequence, int]] = []  # (sequence, tokens this step)
        fed: list[tuple[int, int]] = []  # (row, out row of the step in flight)
        budget = self.step_rows
        prefilling = []
        for s in self.running:
            pending = s.pending
            if pending == 1:
                rows.append((s, 1))
                budget -= 1
            elif pending > 1:
                prefilling.append(s)
            elif pending == 0 and feed_from is not None and s in feed_from and self._room(s):
                fed.append((len(rows), feed_from[s]))
                rows.append((s, 1))
                budget -= 1
        for s in prefilling:
            if budget <= 0:
                break
            n = min(s.pending, self.prefill_chunk, budget)
            if self.recurrent:
                # end at the next snapshot point: the states exist only where a step ends
                marks = self._marks(s, s.computed + n)
                n = marks[0] - s.computed if marks else n
            rows.append((s, n))
            budget -= n
        if not rows:
            return None
        feed = _runs(fed)
        if not prefilling:
            # every row a decoding sequence's one token (the steady state): no per-token lists
            seqs = [s for s, _ in rows]
            for s in seqs:
                if s.computed >= len(s.blocks) * self.block:
                    self._grow(s, s.computed + 1)
            # a fed row's id is a placeholder: the device writes it
            ids = np.fromiter((s.tokens[-1] if s.pending else 0 for s in seqs), np.int64, len(seqs))
            pos = np.fromiter((s.computed for s in seqs), np.int32, len(seqs))
            seq_rows = np.fromiter((s.slot for s in seqs), np.int32, len(seqs))
            out = np.arange(len(seqs), dtype=np.int32)
            return rows, ids, pos, seq_rows, out, seqs, feed
        ids_l, pos_l, seq_l, out_l, wanted = [], [], [], [], []
        for s, n in rows:
            first = s.computed
            self._grow(s, first + n)
            if s.pending:
                ids_l.extend(s.tokens[first : first + n])
            else:
                ids_l.append(0)  # fed on the device
            pos_l.extend(range(first, first + n))
            seq_l.extend([s.slot] * n)
            if first + n >= len(s.tokens):
                out_l.append(len(ids_l) - 1)
                wanted.append(s)
        ids = np.array(ids_l, np.int64)
        pos = np.array(pos_l, np.int32)
        seq_rows = np.array(seq_l, np.int32)
        return rows, ids, pos, seq_rows, np.array(out_l, np.int32), wanted, feed

    def _room(self, s: Sequence) -> bool:
        """Whether s may compute one more position than it has tokens (a fed row)."""
        return s.computed < min(self.max_context, (len(s.blocks) + s.quota) * self.block)

    def _step_without_logits(self, ids, pos, seq_rows) -> np.ndarray:
        # every row is a prefill chunk that does not reach its prompt's end: the entry point
        # always writes at least one row of logits, so the last row's are computed and dropped
        self.backend.step(
            np.array(ids, np.int64),
            np.array(pos, np.int32),
            np.array(seq_rows, np.int32),
            self.tables,
            np.array([len(ids) - 1], np.int32),
        )
        return np.empty((0, self.vocab_size), np.float32)

    def _keep(self, s: Sequence) -> None:
        """Snapshot s's recurrent states at s.computed (a block end), least recently used
        dropped past max_snapshots."""
        key = s.hashes[s.computed // self.block - 1]
        if self._coming.get(key) is s:
            del self._coming[key]
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        if self.max_snapshots <= 0:
            return
        snapshot = self.backend.snapshot(s.slot)
        if snapshot is None:  # no memory for a copy (a GPU's): none kept here
            return
        self.snapshots[key] = snapshot
        while len(self.snapshots) > self.max_snapshots:
            release_snapshot(self.backend, self.snapshots.popitem(last=False)[1])

    def drop_snapshots(self) -> None:
        """Forget every snapshot (a GPU backend reuses their buffers)."""
        while self.snapshots:
            release_snapshot(self.backend, self.snapshots.popitem()[1])

    def _grow(self, s: Sequence, positions: int) -> None:
        while len(s.blocks) * self.block < positions:
            b = self.pool.allocate()
            s.quota -= 1
            self.tables[s.slot, len(s.blocks)] = b
            s.blocks.append(b)

    def _computed(self, s: Sequence, computed: int) -> None:
        s.computed = computed
        self._publish(s)

    def _publish(self, s: Sequence) -> None:
        """Offer s's full blocks to the prefix cache: those computed (or being computed) whose
        tokens are all known. The prompt's blocks by their known hashes; blocks past the
        prompt by the hash chained over every token fed so far (a chat's earlier reply, sent
        back as its next prompt, finds them)."""
        if not self.pool.caching:
            return
        full = min(s.computed, len(s.tokens)) // self.block
        if full <= s.published:
            return
        if full > len(s.hashes):
            parent = s.hashes[-1] if s.hashes else b""
            tail = s.tokens[len(s.hashes) * self.block : full * self.block]
            s.hashes.extend(block_hashes(tail, self.block, parent))
        for i in range(s.published, full):
            self.pool.publish(s.blocks[i], s.hashes[i])
            if self._coming.get(s.hashes[i]) is s:
                del self._coming[s.hashes[i]]
        s.published = full
