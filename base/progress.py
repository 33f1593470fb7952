"""Byte progress bars through tqdm, drawn only on a terminal: a log keeps the stage lines."""

from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm


def byte_bar(label: str, total: int, show: bool = True) -> tqdm:
    """A bar of `total` bytes on stderr (a no-op object when not shown or not a terminal)."""
    return tqdm(
        total=total,
        desc=f"hipc: {label}",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not (show and sys.stderr.isatty()),
        dynamic_ncols=True,
    )


def byte_progress(label: str, show: bool = True) -> Callable[[int, int], None] | None:
    """An on_progress(done, total) callback drawing a byte bar; None when nothing is drawn,
    so the writer skips the calls."""
    if not (show and sys.stderr.isatty()):
        return None
    bar: tqdm | None = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = byte_bar(label, total)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update
