"""A compiled artifact behind the generation-engine interface.

Prompts longer than the artifact's step size are prefilled in chunks; only the last
token's logits are computed unless all rows are asked for (`logits`).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hipc.base.errors import HipcError
from hipc.runtime.artifact import Artifact, load_artifact
from hipc.runtime.recurrent import SNAPSHOT_INTERVAL, RecurrentSequence


class CompiledEngine:
    def __init__(self, artifact: Artifact, backend) -> None:
        self.artifact = artifact
        self.backend = backend
        self.max_context = backend.max_context
        self.vocab_size = artifact.plan["vocab_size"]
        self._tokenizer = None
        # submitted steps, oldest first: (tokens, start, on the backend, its argmax picked
        # there); two only where the second went ahead of the first (submit_next)
        self._queued: deque[tuple] = deque()
        # recurrent states: prefix reuse from snapshots, where the backend can copy them
        self.sequence = None
        if any(s.kind == "recurrent" for s in artifact.states) and hasattr(backend, "snapshot"):
            every = getattr(backend, "snapshot_interval", SNAPSHOT_INTERVAL)
            self.sequence = RecurrentSequence(self._step, backend, self.max_context, every)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.artifact.tokenizer()
        return self._tokenizer

    @property
    def prefix_reuse(self) -> bool:
        """Whether states left by a prompt may be reused by a sequence starting with it."""
        return self.artifact.prefix_reuse

    @property
    def reused(self) -> int:
        """Positions the last prompt took from a snapshot of the recurrent states."""
        return self.sequence.reused if self.sequence else 0

    def reset(self) -> None:
        """Start a new sequence: each state follows its kind's reset rule (a recurrent state
        is zeroed; a KV cache is not: attention reads only positions this sequence wrote)."""
        self._drain()
        if self.sequence:
            self.sequence.reset()
        else:
            self.backend.reset()

    def _step(self, tokens: list[int], start: int, all_rows: bool) -> np.ndarray:
        return self._run(tokens, start, all_rows)  # [1, vocab] unless all rows

    def _check(self, tokens: Sequence[int], start: int) -> None:
        if len(tokens) == 1:  # a decode step (every token of a generation): no array
            if not 0 <= int(tokens[0]) < self.vocab_size:
                raise HipcError(f"token id out of vocabulary (size {self.vocab_size})")
            return
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size == 0:
            raise HipcError("no tokens to run")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise HipcError(f"token id out of vocabulary (size {self.vocab_size})")

    def _run(
        self, tokens: Sequence[int], start: int, all_logits: bool, copy: bool = True
    ) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size == 0:
            raise HipcError("no tokens to run")
        if start + ids.size > self.max_context:
            raise HipcError(
                f"context overflow: {start + ids.size} positions, the artifact holds {self.max_context}"
            )
        # (one token, a decode step: no array reductions, no chunking)
        if ids.size == 1:
            if not 0 <= int(ids[0]) < self.vocab_size:
                raise HipcError(f"token id out of vocabulary (size {self.vocab_size})")
            return self.backend.forward(ids, start, all_logits, copy=copy)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise HipcError(f"token id out of vocabulary (size {self.vocab_size})")
        step = self.backend.max_tokens
        outs = []
        for i in range(0, ids.size, step):
            chunk = ids[i : i + step]
            last = i + step >= ids.size
            if all_logits or last:
                outs.append(self.backend.forward(chunk, start + i, all_logits))
            else:
                self.backend.forward(chunk, start + i, False)
        return np.concatenate(outs) if all_logits else outs[-1]

    def forward(self, tokens: Sequence[int], start: int, copy: bool = True) -> np.ndarray:
        """Logits of the last token [vocab]. `copy` False: a decode step's logits may be a
        view of the backend's output buffer, valid until the next step (llama.cpp's
        llama_get_logits contract): a GPU backend then skips copying half a MiB out of its
        pinned buffer per token, which costs ~50 us where the row is cold in the CPU's cache."""
        self._drain()
        if self.sequence:
            self._check(tokens, start)
            return self.sequence.forward(list(tokens), start)
        return self._run(tokens, start, False, copy)[-1]

    def submit(
        self,
        tokens: Sequence[int],
        start: int,
        argmax: bool = False,
        draw: tuple[float, float] | None = None,
    ) -> None:
        """Start the step of `tokens` (at most one step's worth) and return before it ends;
        `collect()` gives its last token's logits. On a GPU the host is free meanwhile (the
        generation loop detokenizes the token before while the next step runs), recurrent
        states too where the step only continues the sequence (no snapshot to take or
        restore around it: most decode steps); elsewhere (the CPU backend, a step at a
        snapshot boundary) the step runs in `collect()`. A step left uncollected is waited
        for by the next call. `argmax`: only the last token's argmax is wanted
        (`collect_argmax()`), which a GPU backend with the top-k kernel picks on the device;
        `draw` (where `can_draw`, with argmax): (1 / temperature, u), the token drawn from the
        softmax at that temperature instead (Decoding.draw), picked on the device."""
        if draw is not None and not (argmax and self.can_draw):
            raise HipcError("this engine draws no tokens on the device")
        self._drain()
        self._check(tokens, start)
        if len(tokens) > self.backend.max_tokens or start + len(tokens) > self.max_context:
            raise HipcError(
                f"submit runs one step within the context: {len(tokens)} tokens at {start}"
            )
        tokens = list(tokens)
        passed = self._async or (
            self.sequence is not None
            and hasattr(self.backend, "submit")
            and self.sequence.continues(tokens, start)
        )
        on_device = passed and argmax and getattr(self.backend, "max_top_k", 0) >= 1
        self._queued.append((tokens, start, passed, on_device))
        if passed:
            top = 1 if on_device else 0
            ids = np.asarray(tokens, dtype=np.int64)
            self.backend.submit(ids, start, False, top=top, **({"draw": draw} if draw else {}))

    @property
    def can_draw(self) -> bool:
        """Whether submit and submit_next can pick a token drawn at a temperature on the device
        (`draw`): a GPU backend whose pick kernel draws, and no recurrent sequence (whose steps
        at a snapshot run on the host)."""
        return self._async and getattr(self.backend, "draws_on_device", 0) >= 1

    @property
    def can_submit_next(self) -> bool:
        """Whether submit_next can queue a step behind the one in flight: a GPU backend with
        the device top-k whose steps pipeline, and no recurrent sequence to keep in step."""
        return (
            self.sequence is None
            and bool(getattr(self.backend, "pipelines", False))
            and getattr(self.backend, "max_top_k", 0) >= 1
        )

    def submit_next(self, start: int, draw: tuple[float, float] | None = None) -> None:
        """Queue the decode step at `start` of the token that the one step in flight (submitted
        with argmax=True, picked on the device) is computing, before it is collected: the
        device goes from step to step with no host round trip between them (a greedy
        generation's loop). collect_argmax() returns the picks in order; a step queued so for a
        sequence that then stops is collected and dropped (its KV entry is past the end).
        `draw`: as submit's, for this step's token."""
        if draw is not None and not self.can_draw:
            raise HipcError("this engine draws no tokens on the device")
        if not self.can_submit_next:
            raise HipcError("this engine cannot queue a step fed on the device")
        if len(self._queued) != 1 or not self._queued[0][3]:
            raise HipcError("a step goes next only of the one in flight, picked on the device")
        if start + 1 > self.max_context:
            raise HipcError(
                f"context overflow: {start + 1} positions, the artifact holds {self.max_context}"
            )
        extra = {"draw": draw} if draw else {}
        self.backend.submit(np.zeros(1, np.int64), start, False, top=1, ahead=True, **extra)
        self._queued.append((None, start, True, True))

    def collect(self, copy: bool = True) -> np.ndarray:
        """Logits of the last token [vocab] of the step `submit` started (`copy` False: a view
        of the backend's buffer where it has one, valid until the next step's logits arrive:
        for a caller done with it before the next submit, such as the generation loop)."""
        if not self._queued:
            raise HipcError("no step in flight")
        tokens, start, passed, on_device = self._queued[0]
        if on_device:
            raise HipcError("the step in flight was submitted for collect_argmax()")
        self._queued.popleft()
        if passed:
            logits = self.backend.collect(copy=copy)[-1]
            if self.sequence is not None:
                self.sequence.ran(tokens, start)
            return logits
        return self.forward(tokens, start)

    def collect_argmax(self) -> int:
        """The argmax of the last token's logits of the step `submit` started (the lowest id
        of equal maxima, as np.argmax), or the token drawn where submitted with a `draw`:
        picked on the device where submit(argmax=True) could ask for it, else from the logits."""
        if not self._queued or not self._queued[0][3]:
            return int(np.argmax(self.collect(copy=False)))
        tokens, start, _, _ = self._queued.popleft()
        top = self.backend.collect()
        if self.sequence is not None:
            self.sequence.ran(tokens, start)
        return int(top[0][-1, 0])

    @property
    def _async(self) -> bool:
        return self.sequence is None and hasattr(self.backend, "submit")

    def drop_steps(self) -> None:
        """Wait for the steps submitted and not collected, and drop them (a generation that
        stopped with a step in flight)."""
        self._drain()

    def _drain(self) -> None:
        """Wait for (and drop) the steps submitted and never collected."""
        while self._queued:
            if self._queued[0][3]:
                self.collect_argmax()
            else:
                self.collect()

    def logits(self, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """Logits of every token [len(tokens), vocab]."""
        self._drain()
        if self.sequence:
            self._check(tokens, start)
            return self.sequence.logits(list(tokens), start)
        return self._run(tokens, start, True)

    def close(self) -> None:
        self._queued.clear()  # closing the backend ends whatever it was running
        self.backend.close()


def load_engine(
    path: str | Path,
    target: str = "auto",
    threads: int | None = None,
    device: int = 0,
    max_context: int | None = None,
    kv_pool_tokens: int | None = None,
) -> CompiledEngine:
    """The artifact at `path` on a backend: `target` "auto" (default), "cpu", "cuda" or "hip"
    (an arch name, "sm_90" or "gfx942", picks its backend). `threads` is the cpu backend's,
    `device` the GPU's ordinal. `max_context` allocates the KV cache for fewer positions than
    the artifact was compiled for (default: all of them; on a GPU, as many as fit).
    `kv_pool_tokens`: positions in the paged KV pool, shared by the sequences of a batch
    (default and minimum: one sequence of max_context; on a GPU, as many as fit)."""
    artifact = load_artifact(path)
    compiled = int(artifact.plan["max_context"])
    if max_context is not None and not 2 <= max_context <= compiled:
        raise HipcError(
            f"max context {max_context}: the artifact's KV cache holds {compiled} positions "
            "(at least 2 are needed); admit fewer, or recompile with a larger --max-context"
        )
    if kv_pool_tokens is not None and kv_pool_tokens < 1:
        raise HipcError(f"KV pool of {kv_pool_tokens} positions: at least 1")
    backend = _backend(artifact, target, threads, device, max_context, kv_pool_tokens)
    return CompiledEngine(artifact, backend)


def _cpu_backend(artifact, threads, max_context, kv_pool_tokens):
    from hipc.runtime.backends.cpu import CpuBackend

    if kv_pool_tokens is None:
        return CpuBackend(artifact, threads, max_context)
    block = int(artifact.plan["targets"]["cpu"].get("kv_block") or 1)
    return CpuBackend(artifact, threads, max_context, kv_blocks=-(-kv_pool_tokens // block))


def _kv_blocks(artifact: Artifact, kv_pool_tokens: int | None) -> int | None:
    """Blocks of a GPU KV pool of `kv_pool_tokens` positions (None: the backend's default)."""
    if kv_pool_tokens is None:
        return None
    block = min(int(s.get("kv_block") or 1) for s in artifact.plan["targets"].values())
    return -(-kv_pool_tokens // max(block, 1))


def _backend(
    artifact: Artifact,
    target: str,
    threads: int | None,
    device: int,
    max_context: int | None,
    kv_pool_tokens: int | None = None,
):
    if target == "cpu":
        return _cpu_backend(artifact, threads, max_context, kv_pool_tokens)
    blocks = _kv_blocks(artifact, kv_pool_tokens)
    if target == "cuda" or target.startswith("sm_"):
        from hipc.runtime.backends.cuda import CudaBackend

        return CudaBackend(artifact, device, max_context=max_context, kv_blocks=blocks)
    if target == "hip" or target.startswith("gfx"):
        from hipc.runtime.backends.hip import HipBackend

        return HipBackend(artifact, device, max_context=max_context, kv_blocks=blocks)
    if target != "auto":
        raise HipcError(f"--target {target}: choose auto, cpu, cuda or hip")
    return _auto_backend(artifact, threads, device, max_context, kv_pool_tokens)


def _auto_backend(
    artifact: Artifact,
    threads: int | None,
    device: int,
    max_context: int | None,
    kv_pool_tokens: int | None = None,
):
    """cuda if an NVIDIA GPU and its sm_XX code object are there, else hip likewise, else cpu.

    Falling back to the CPU is said on stderr when it is a surprise: a GPU was found
    without a code object for it, or the artifact has GPU code objects but no GPU
    could run them.
    """
    from hipc.runtime.backends import cuda, hip

    targets = set(artifact.targets)
    notes = []
    blocks = _kv_blocks(artifact, kv_pool_tokens)
    kw = dict(max_context=max_context, kv_blocks=blocks)
    for module, prefix, backend in (
        (cuda, "sm_", lambda: cuda.CudaBackend(artifact, device, **kw)),
        (hip, "gfx", lambda: hip.HipBackend(artifact, device, **kw)),
    ):
        arch, what = module.probe(device)
        if arch is not None and arch in targets:
            return backend()
        if arch is not None:
            notes.append(
                f"{what} ({arch}) found, but the artifact has no {arch} code object "
                f"(compile for it with: hipc compile MODEL --target {arch})"
            )
        elif any(t.startswith(prefix) for t in targets):
            notes.append(f"{what}, so the {prefix}* code objects cannot run")
    if "cpu" not in targets:
        raise HipcError(
            f"{artifact.path}: nothing here can run this artifact (targets: "
            f"{', '.join(sorted(targets))}): {'; '.join(notes) or 'no GPU found'}"
        )
    if notes:
        print(f"hipc: running on the CPU: {'; '.join(notes)}", file=sys.stderr)
    return _cpu_backend(artifact, threads, max_context, kv_pool_tokens)
