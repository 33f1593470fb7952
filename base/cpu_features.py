"""The CPU feature flags the cpu target compiles against and the runtime checks at load."""

from __future__ import annotations

from pathlib import Path


def cpu_features() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
