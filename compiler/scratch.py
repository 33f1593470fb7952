"""Scratch paths a compile writes before its output is in place, and sweeping what a
killed compile left of them.

A compile writes its artifact into `.NAME.hipc.tmp-PID` beside the output and its
toolchains work in `$TMPDIR/hipc-{cc,nvcc,clang}-PID-*`; a compile killed midway leaves
them behind (up to the size of the weights). Every such name carries the PID of the
process that made it, so a later process can tell a leftover (its PID no longer runs)
from another compile's work in progress. The artifact's scratch directory is also
recorded under `<cache>/pending/`, so `hipc cache clear` finds leftovers wherever `-o`
pointed. `replace_dir` puts a finished artifact in place atomically.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TOOL_PREFIXES = ("hipc-cc-", "hipc-nvcc-", "hipc-clang-")
_TOOL_RE = re.compile(r"^hipc-(?:cc|nvcc|clang)-(\d+)-")
_ARTIFACT_RE = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")
PENDING_DIR = "pending"


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def tool_dir(prefix: str) -> tempfile.TemporaryDirectory:
    """A toolchain's scratch directory, named so a leftover can be swept."""
    sweep_tool_dirs()
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-")


def sweep_tool_dirs(root: Path | None = None) -> list[Path]:
    """Remove toolchain scratch directories of processes that no longer run."""
    root = Path(root or tempfile.gettempdir())
    return _sweep(root, _TOOL_RE)


def sweep_artifact_leftovers(parent: Path) -> list[Path]:
    """Remove `.NAME.tmp-PID` / `.NAME.old-PID` directories of dead compiles in `parent`."""
    return _sweep(parent, _ARTIFACT_RE)


def _sweep(root: Path, pattern: re.Pattern) -> list[Path]:
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass  # another process swept it first, or it is not ours to remove
    return removed


@contextlib.contextmanager
def pending(cache_root: Path | None, scratch: Path) -> Iterator[None]:
    """Record `scratch` under the cache while a compile writes it, for `hipc cache clear`."""
    record = None
    if cache_root is not None:
        record = Path(cache_root) / PENDING_DIR / f"{os.getpid()}-{scratch.name}.json"
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"pid": os.getpid(), "path": str(scratch)}))
        except OSError:
            record = None  # a read-only cache: the next compile in that folder still sweeps
    try:
        yield
    finally:
        if record is not None:
            with contextlib.suppress(OSError):
                record.unlink()


def sweep_pending(cache_root: Path) -> list[Path]:
    """Remove the scratch directories recorded by compiles that no longer run."""
    removed = []
    folder = Path(cache_root) / PENDING_DIR
    try:
        records = list(folder.glob("*.json"))
    except OSError:
        return removed
    for record in records:
        try:
            info = json.loads(record.read_text())
            pid, path = int(info["pid"]), Path(info["path"])
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                record.unlink()
            continue
        if pid_alive(pid):
            continue
        # only what this module names: a record cannot make us remove anything else
        if _ARTIFACT_RE.match(path.name) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        for sibling in sweep_artifact_leftovers(path.parent):
            removed.append(sibling)
        with contextlib.suppress(OSError):
            record.unlink()
    return removed


# ------------------------------------------------------------------ atomic replace

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where that is not available."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):
        return False  # the kernel or the filesystem cannot exchange
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, dest: Path) -> None:
    """Put directory `new` at `dest`, replacing what is there, so that `dest` always holds
    a complete artifact: the old one or the new one, never nothing, even if the process
    dies midway or another compile finishes at the same moment."""
    for _ in range(10):
        if not os.path.lexists(dest):
            try:
                os.rename(new, dest)  # fails on a non-empty dest another process put there
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue
        try:
            swapped = _exchange(new, dest)
        except FileNotFoundError:
            continue  # dest went away in between: rename instead
        if swapped:
            shutil.rmtree(new, ignore_errors=True)  # `new` now names the old artifact
            return
        break
    # Without an atomic exchange: two renames, the old artifact kept until the new is in
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)
