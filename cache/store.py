"""On-disk, content-addressed store of compiled kernels.

Layout under the cache root::

    <root>/<digest[:2]>/<digest>/payload.bin   the compiled bytes
    <root>/<digest[:2]>/<digest>/entry.json    key fields, sha256, size, created, meta
    <root>/<digest[:2]>/.tmp-*                 entries being written (never read)
    <root>/<digest[:2]>/.trash-*               entries being removed (never read)
    <root>/.locks/<digest>.lock                per-key flock(2) lock files
    <root>/artifacts/<key>/model.hipc          raw models compiled on demand (compiler/cached.py)

Publishing is atomic: an entry is written completely into a temp directory next to
its final place (payload.bin, then entry.json last, each fsynced), and the directory is
then renamed into place. So an entry directory either is complete or does not exist; a
process killed midway leaves only a ``.tmp-*`` directory that is never read;
``sweep_temp`` removes old ones (every compile calls ``trim``, which sweeps). Every load
re-checks entry.json and the payload's sha256 and size; a damaged entry is logged, removed
and reported as a miss, never returned.

The folder is bounded: ``trim`` (run after every compile) drops the least recently used
kernels and cached artifacts together until they fit in ``$HIPC_CACHE_MAX_BYTES``
(default 10 GiB; 0 = no bound), skipping an artifact a live compile is writing. A hit bumps an entry's entry.json mtime, a reused
artifact its folder's mtime: the LRU clock, since atime is unreliable (noatime).

``get_or_build`` holds a per-key ``flock`` while it builds, so concurrent processes
asking for the same key build it once; where locking is unavailable (no fcntl, a
filesystem without flock, ``lock=False``) every process may build, and the atomic
rename still leaves exactly one complete entry.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hipc.base.errors import HipcError
from hipc.cache.key import KEY_SCHEMA, CacheKey

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("hipc.cache")

PAYLOAD_NAME = "payload.bin"
ENTRY_NAME = "entry.json"
LOCK_DIR = ".locks"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
ARTIFACTS_DIR = "artifacts"
# NOTE: cached artifacts hold a copy of the weights (SmolLM2: 190 MB; an 8B model: ~5 GB);
# 10 GiB keeps a few while a disk is not filled by models compiled once and forgotten
DEFAULT_MAX_BYTES = 10 * 2**30
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}

_FANOUT_RE = re.compile(r"[0-9a-f]{2}")
# a compile writing a cached artifact (compiler/artifact.py's scratch naming)
_WRITING_RE = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def default_cache_dir() -> Path:
    """``$HIPC_CACHE_DIR``, else ``$XDG_CACHE_HOME/hipc``, else ``~/.cache/hipc``.

    Empty variables count as unset; ``~`` is expanded.
    """
    explicit = os.environ.get("HIPC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "hipc"
    return Path.home() / ".cache" / "hipc"


def max_bytes_from_env() -> int | None:
    """``$HIPC_CACHE_MAX_BYTES`` (bytes, or with a K/M/G/T suffix: binary units); None = no bound."""
    raw = os.environ.get("HIPC_CACHE_MAX_BYTES", "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", raw.lower())
    if m is None:
        raise HipcError(
            f"HIPC_CACHE_MAX_BYTES={raw!r}: expected a size such as 5000000000, 500M or 10G "
            "(0 = no bound)"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2)])
    return value or None


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _being_written(folder: Path) -> bool:
    """True while a live process compiles into this cached-artifact folder."""
    try:
        children = list(folder.iterdir())
    except OSError:
        return False
    for child in children:
        m = _WRITING_RE.match(child.name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue  # a killed compile's leftover: the folder may go
        except PermissionError:
            pass  # another user's live process
        return True
    return False


def _why(exc: OSError) -> str:
    return (exc.strerror or str(exc)).replace("\n", " ")


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation in ``path`` durable (best effort; not on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


class _Corrupt(Exception):
    """An entry exists but must not be loaded."""


class KernelCache:
    """Content-addressed store of compiled kernel bytes keyed by ``CacheKey``."""

    def __init__(self, root: Path | None = None, *, lock: bool = True) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self._use_lock = lock

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    # -- paths -----------------------------------------------------------------------

    def entry_dir(self, key: CacheKey) -> Path:
        digest = key.digest
        return self.root / digest[:2] / digest

    def _ensure_root(self) -> None:
        """Create the root if needed; a user-fixable problem becomes a HipcError."""
        root = self.root
        if root.exists() and not root.is_dir():
            raise HipcError(f"cache directory {root} exists and is not a directory")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HipcError(f"cannot create cache directory {root}: {_why(e)}") from e
        if not os.access(root, os.W_OK | os.X_OK):
            raise HipcError(f"cache directory {root} is not writable")

    # -- locking ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _key_lock(self, digest: str) -> Iterator[None]:
        """Exclusive per-key lock; degrades to no lock where flock is unavailable."""
        if not self._use_lock or fcntl is None:
            yield
            return
        lock_dir = self.root / LOCK_DIR
        lock_path = lock_dir / f"{digest}.lock"
        try:
            lock_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise HipcError(f"cannot create cache lock file {lock_path}: {_why(e)}") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # e.g. ENOLCK / EOPNOTSUPP on some network filesystems
                logger.debug("hipc cache: flock unavailable on %s (%s)", lock_path, _why(e))
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- reading ---------------------------------------------------------------------

    def _load(self, key: CacheKey, entry: Path) -> bytes:
        """Payload of a verified entry. FileNotFoundError: absent; _Corrupt: damaged."""
        try:
            raw = (entry / ENTRY_NAME).read_bytes()
        except FileNotFoundError:
            if entry.is_dir() or entry.exists():
                raise _Corrupt("entry.json is missing") from None
            raise
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _Corrupt("entry.json is not valid JSON") from None
        if (
            not isinstance(doc, dict)
            or doc.get("digest") != key.digest
            or not isinstance(doc.get("sha256"), str)
            or not isinstance(doc.get("size"), int)
        ):
            raise _Corrupt("entry.json does not describe this key")
        try:
            payload = (entry / PAYLOAD_NAME).read_bytes()
        except FileNotFoundError:
            raise _Corrupt("payload.bin is missing") from None
        if len(payload) != doc["size"]:
            raise _Corrupt(f"payload is {len(payload)} bytes, expected {doc['size']}")
        if hashlib.sha256(payload).hexdigest() != doc["sha256"]:
            raise _Corrupt("payload sha256 mismatch")
        return payload

    def get(self, key: CacheKey) -> bytes | None:
        """The cached bytes for ``key``, or None. A damaged entry is removed (-> None)."""
        entry = self.entry_dir(key)
        try:
            ino = entry.stat().st_ino
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            logger.warning("hipc cache: cannot read %s (%s); treating as a miss", entry, _why(e))
            return None
        try:
            payload = self._load(key, entry)
        except (FileNotFoundError, NotADirectoryError):
            return None  # removed concurrently (clear/evict/replace)
        except _Corrupt as e:
            logger.warning("hipc cache: corrupt entry %s (%s); removing it", entry, e)
            self._discard(entry, expected_ino=ino)
            return None
        except OSError as e:
            logger.warning("hipc cache: cannot read %s (%s); treating as a miss", entry, _why(e))
            return None
        with contextlib.suppress(OSError):  # LRU mark; a read-only cache just doesn't
            os.utime(entry / ENTRY_NAME)
        return payload

    # -- writing ---------------------------------------------------------------------

    def _discard(self, entry: Path, expected_ino: int | None = None) -> None:
        """Remove ``entry`` without ever exposing a half-deleted entry to readers.

        It is first renamed aside (atomic), then deleted. If ``expected_ino`` is given
        and the directory moved aside is not that one (it was replaced meanwhile by a
        fresh entry), it is put back instead.
        """
        trash = entry.parent / f"{TRASH_PREFIX}{entry.name[:16]}-{secrets.token_hex(6)}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        except OSError as e:
            logger.warning("hipc cache: cannot remove %s (%s)", entry, _why(e))
            return
        if expected_ino is not None:
            with contextlib.suppress(OSError):
                if trash.stat().st_ino != expected_ino:
                    os.rename(trash, entry)
                    return
        _remove_path(trash)

    def put(self, key: CacheKey, payload: bytes, meta: dict | None = None) -> Path:
        """Store ``payload`` for ``key`` atomically (replacing any entry); its directory."""
        self._ensure_root()
        with self._key_lock(key.digest):
            return self._publish(key, payload, meta or {})

    def _publish(self, key: CacheKey, payload: bytes, meta: dict) -> Path:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        digest = key.digest
        doc = {
            "schema": KEY_SCHEMA,
            "digest": digest,
            "key": key.as_dict(),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "size": len(payload),
            "created": time.time(),
            "meta": meta,
        }
        entry_json = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode("utf-8")

        fanout = self.root / digest[:2]
        final = fanout / digest
        tmp = fanout / f"{TMP_PREFIX}{digest[:16]}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fanout.mkdir(exist_ok=True)
            os.mkdir(tmp)
        except OSError as e:
            raise HipcError(f"cannot write cache entry under {fanout}: {_why(e)}") from e
        try:
            _write_file(tmp / PAYLOAD_NAME, payload)
            _write_file(tmp / ENTRY_NAME, entry_json)  # last: it makes the entry valid
            _fsync_dir(tmp)
            for _ in range(16):
                try:
                    os.rename(tmp, final)
                    break
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                        raise
                    self._discard(final)  # an older or damaged entry is in the way
            else:
                raise HipcError(f"cannot place cache entry {final}: it keeps being recreated")
            _fsync_dir(fanout)
        except OSError as e:
            raise HipcError(f"cannot write cache entry {final}: {_why(e)}") from e
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def get_or_build(
        self,
        key: CacheKey,
        build: Callable[[], bytes],
        meta: dict | None = None,
    ) -> tuple[bytes, bool]:
        """``(payload, hit)``. On a miss, run ``build()`` under the key's lock and store it.

        A concurrent process building the same key makes this one wait and then read
        its entry. If ``build`` raises, nothing is stored and the error propagates.
        """
        payload = self.get(key)
        if payload is not None:
            return payload, True
        self._ensure_root()  # fail on an unusable cache before a long compile
        with self._key_lock(key.digest):
            payload = self.get(key)
            if payload is not None:
                return payload, True
            built = build()
            if not isinstance(built, (bytes, bytearray, memoryview)):
                raise TypeError(f"build() must return bytes, got {type(built).__name__}")
            built = bytes(built)
            self._publish(key, built, meta or {})
            return built, False

    # -- maintenance -----------------------------------------------------------------

    def _scan_fanouts(self) -> list[Path]:
        try:
            children = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        except NotADirectoryError as e:
            raise HipcError(f"cache directory {self.root} is not a directory") from e
        except OSError as e:
            raise HipcError(f"cannot read cache directory {self.root}: {_why(e)}") from e
        return sorted(p for p in children if _FANOUT_RE.fullmatch(p.name) and p.is_dir())

    def _fanout_children(self) -> Iterator[tuple[Path, list[Path]]]:
        """(fanout dir, its children, sorted) per readable fanout dir."""
        for fanout in self._scan_fanouts():
            try:
                yield fanout, sorted(fanout.iterdir())
            except OSError:
                continue

    def _entries(self) -> Iterator[tuple[Path, dict | None, int, float]]:
        """(entry dir, parsed entry.json or None, bytes on disk, last used) per entry."""
        for _fanout, children in self._fanout_children():
            for entry in children:
                if not _DIGEST_RE.fullmatch(entry.name):
                    continue
                size = 0
                last_used = 0.0
                doc = None
                with contextlib.suppress(OSError):
                    for f in entry.iterdir():
                        st = f.stat()
                        size += st.st_size
                        if f.name == ENTRY_NAME:
                            # mtime, bumped by get() on every hit; atime is unreliable
                            # (noatime/relatime) and would be bumped by our own scans.
                            last_used = st.st_mtime
                with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
                    doc = json.loads((entry / ENTRY_NAME).read_bytes())
                    if not isinstance(doc, dict):
                        doc = None
                yield entry, doc, size, last_used

    def _artifacts(self) -> Iterator[tuple[Path, int, float]]:
        """(folder, bytes on disk, last used) per cached artifact (compiler/cached.py)."""
        try:
            folders = sorted((self.root / ARTIFACTS_DIR).iterdir())
        except OSError:
            return
        for folder in folders:
            if folder.name.startswith(".") or not folder.is_dir() or folder.is_symlink():
                continue
            with contextlib.suppress(OSError):
                yield folder, _tree_bytes(folder), folder.stat().st_mtime

    def artifact_dir(self, key: str) -> Path:
        """Where the raw model with this key is compiled to (``<dir>/model.hipc``)."""
        return self.root / ARTIFACTS_DIR / key

    def mark_used(self, artifact_dir: Path) -> None:
        """Make a cached artifact the most recently used (the LRU clock is its mtime)."""
        with contextlib.suppress(OSError):
            os.utime(artifact_dir)

    def info(self) -> dict:
        """What the cache folder holds: kernels (``entries``, ``targets``, ``kernel_bytes``),
        cached artifacts (``artifacts``, ``artifact_bytes``), the rest (temp leftovers,
        locks, stamps: ``other_bytes``), ``total_bytes`` on disk and the bound ``max_bytes``."""
        entries = 0
        kernel_bytes = 0
        targets: dict[str, int] = {}
        for _entry, doc, size, _last in self._entries():
            if doc is None:
                continue  # damaged; removed on its next load
            entries += 1
            kernel_bytes += size
            key = doc.get("key")
            target = key.get("target") if isinstance(key, dict) else None
            target = target if isinstance(target, str) else "?"
            targets[target] = targets.get(target, 0) + 1
        artifacts = list(self._artifacts())
        artifact_bytes = sum(a[1] for a in artifacts)
        total = _tree_bytes(self.root) if self.root.is_dir() else 0
        return {
            "root": str(self.root),
            "max_bytes": max_bytes_from_env(),
            "total_bytes": total,
            "entries": entries,
            "targets": dict(sorted(targets.items())),
            "kernel_bytes": kernel_bytes,
            "artifacts": len(artifacts),
            "artifact_bytes": artifact_bytes,
            "other_bytes": max(total - kernel_bytes - artifact_bytes, 0),
        }

    def _discard_artifact(self, folder: Path) -> None:
        trash = folder.parent / f"{TRASH_PREFIX}{folder.name}-{secrets.token_hex(6)}"
        try:
            os.rename(folder, trash)  # atomic: a reader sees the artifact or nothing
        except OSError:
            return
        _remove_path(trash)

    def clear_artifacts(self) -> int:
        """Remove every cached artifact (and leftovers of removals); the count."""
        removed = 0
        for folder, _size, _last in list(self._artifacts()):
            if _being_written(folder):
                continue  # another compile's output; removing it would fail that compile
            self._discard_artifact(folder)
            removed += 1
        with contextlib.suppress(OSError):
            for child in (self.root / ARTIFACTS_DIR).iterdir():
                if child.name.startswith(TRASH_PREFIX):
                    _remove_path(child)
        return removed

    def clear(self) -> int:
        """Remove every kernel entry, temp file and lock file; the number of entries removed."""
        removed = 0
        for fanout, children in self._fanout_children():
            for child in children:
                if _DIGEST_RE.fullmatch(child.name):
                    self._discard(child)
                    removed += 1
                elif child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    _remove_path(child)
            with contextlib.suppress(OSError):
                fanout.rmdir()  # only if empty
        # Lock files held right now stay valid for their holders; a new process may
        # then build concurrently, which the atomic rename keeps correct.
        shutil.rmtree(self.root / LOCK_DIR, ignore_errors=True)
        return removed

    def evict(self, max_bytes: int, keep: Sequence[Path] = ()) -> int:
        """Drop least recently used kernels and cached artifacts until at most
        ``max_bytes`` of them remain (never one in ``keep``); the count removed."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        kept = {Path(k).resolve() for k in keep}
        items = [(last, entry, size, False) for entry, _doc, size, last in self._entries()]
        items += [(last, folder, size, True) for folder, size, last in self._artifacts()]
        items.sort(key=lambda item: item[0])
        total = sum(item[2] for item in items)
        removed = 0
        for _last, path, size, is_artifact in items:
            if total <= max_bytes:
                break
            if any(k == path.resolve() or path.resolve() in k.parents for k in kept):
                continue
            if is_artifact and _being_written(path):
                continue
            if is_artifact:
                self._discard_artifact(path)
            else:
                self._discard(path)
            total -= size
            removed += 1
        return removed

    def trim(self, max_bytes: int | None, keep: Sequence[Path] = ()) -> tuple[int, int]:
        """What a compile runs afterwards: sweep old temp leftovers, then evict down to
        ``max_bytes`` (None: no bound). ``(temp dirs swept, entries evicted)``."""
        swept = self.sweep_temp()
        evicted = self.evict(max_bytes, keep) if max_bytes is not None else 0
        return swept, evicted

    def sweep_temp(self, older_than_s: float = 3600) -> int:
        """Remove leftover temp/trash dirs older than ``older_than_s``; the count."""
        cutoff = time.time() - older_than_s
        removed = 0
        for _fanout, children in self._fanout_children():
            for child in children:
                if not child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    continue
                try:
                    if child.lstat().st_mtime > cutoff:
                        continue
                except OSError:
                    continue
                _remove_path(child)
                removed += 1
        with contextlib.suppress(OSError):
            for child in (self.root / ARTIFACTS_DIR).iterdir():
                if child.name.startswith(TRASH_PREFIX) and child.lstat().st_mtime <= cutoff:
                    _remove_path(child)
                    removed += 1
        return removed
