"""Tests for the content-addressed kernel cache (hipc.cache)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from hipc.base.errors import HipcError
from hipc.cache import CacheKey, KernelCache, default_cache_dir
from hipc.cache.store import ENTRY_NAME, PAYLOAD_NAME, TMP_PREFIX

SOURCE = "__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n"
PAYLOAD = b"\x7fELF fake cubin \x00\x01\x02" * 50


def make_key(**overrides) -> CacheKey:
    fields = {
        "toolchain": "nvcc 13.0.88",
        "flags": ("-O3", "--use_fast_math"),
        "target": "sm_90",
        "hipc_version": "0.1.0",
    }
    source = overrides.pop("source", SOURCE)
    fields.update(overrides)
    return CacheKey.for_source(source, **fields)


def entry_files(cache: KernelCache, key: CacheKey) -> tuple[Path, Path]:
    entry = cache.entry_dir(key)
    return entry / PAYLOAD_NAME, entry / ENTRY_NAME


def temp_dirs(root: Path) -> list[Path]:
    return [p for p in root.glob("*/*") if p.name.startswith(TMP_PREFIX)]


# -- keys ------------------------------------------------------------------------------


def test_key_digest_is_canonical_and_stable():
    key = make_key()
    assert key.source_sha256 == hashlib.sha256(SOURCE.encode()).hexdigest()
    assert key.digest == hashlib.sha256(key.canonical_json().encode()).hexdigest()
    assert len(key.digest) == 64
    # Same inputs, however the flags are passed, give the same key and digest.
    again = make_key(flags=["-O3", "--use_fast_math"])
    assert again == key and hash(again) == hash(key)
    assert again.digest == key.digest
    assert isinstance(again.flags, tuple)


@pytest.mark.parametrize(
    "change",
    [
        {"source": SOURCE + " "},
        {"toolchain": "nvcc 13.0.89"},
        {"flags": ("-O2", "--use_fast_math")},
        {"flags": ("--use_fast_math", "-O3")},  # order matters to compilers
        {"flags": ("-O3",)},
        {"target": "sm_89"},
        {"hipc_version": "0.1.1"},
    ],
)
def test_key_changes_with_every_field(change):
    assert make_key(**change).digest != make_key().digest


def test_key_rejects_bad_fields():
    with pytest.raises(ValueError):
        CacheKey("nothex", "g++ 12.2.0", (), "cpu-x86_64-avx2", "0.1.0")
    with pytest.raises(TypeError):
        make_key(flags="-O3")
    with pytest.raises(ValueError):
        make_key(target="")
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_key().target = "sm_80"  # type: ignore[misc]


# -- round trip and damage -------------------------------------------------------------


def test_round_trip(tmp_path):
    cache = KernelCache(tmp_path / "c")
    key = make_key()
    assert cache.get(key) is None
    entry = cache.put(key, PAYLOAD, {"kernel": "k"})
    assert entry == tmp_path / "c" / key.digest[:2] / key.digest
    assert cache.get(key) == PAYLOAD

    doc = json.loads((entry / ENTRY_NAME).read_text())
    assert doc["digest"] == key.digest
    assert doc["sha256"] == hashlib.sha256(PAYLOAD).hexdigest()
    assert doc["size"] == len(PAYLOAD)
    assert doc["key"]["target"] == "sm_90"
    assert doc["key"]["flags"] == ["-O3", "--use_fast_math"]
    assert doc["meta"] == {"kernel": "k"}
    assert isinstance(doc["created"], float)
    assert temp_dirs(tmp_path / "c") == []

    # A second cache object on the same root sees it; get_or_build is a hit.
    data, hit = KernelCache(tmp_path / "c").get_or_build(key, lambda: pytest.fail("built"))
    assert (data, hit) == (PAYLOAD, True)

    # put replaces an existing entry.
    cache.put(key, b"new bytes", {})
    assert cache.get(key) == b"new bytes"


def _builder(payload: bytes, calls: list):
    def build() -> bytes:
        calls.append(1)
        return payload

    return build


def test_flipped_byte_is_detected_and_rebuilt(tmp_path, caplog):
    cache = KernelCache(tmp_path)
    key = make_key()
    cache.put(key, PAYLOAD, {})
    payload_file, _ = entry_files(cache, key)
    data = bytearray(payload_file.read_bytes())
    data[17] ^= 0x01
    payload_file.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="hipc.cache"):
        assert cache.get(key) is None
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    assert not cache.entry_dir(key).exists()

    payload_file.parent.mkdir(parents=True)  # damage it again, then rebuild over it
    payload_file.write_bytes(bytes(data))
    calls: list = []
    assert cache.get_or_build(key, _builder(PAYLOAD, calls)) == (PAYLOAD, False)
    assert cache.get_or_build(key, _builder(PAYLOAD, calls)) == (PAYLOAD, True)
    assert len(calls) == 1


def test_truncated_payload_is_detected(tmp_path):
    cache = KernelCache(tmp_path)
    key = make_key()
    cache.put(key, PAYLOAD, {})
    payload_file, _ = entry_files(cache, key)
    with open(payload_file, "r+b") as f:
        f.truncate(len(PAYLOAD) // 2)
    assert cache.get(key) is None
    assert not cache.entry_dir(key).exists()
    calls: list = []
    assert cache.get_or_build(key, _builder(PAYLOAD, calls)) == (PAYLOAD, False)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.unlink(),
        lambda p: p.write_text("{not json"),
        lambda p: p.write_bytes(b"\xff\xfe\x00"),
        lambda p: p.write_text("[1, 2]"),
        lambda p: p.write_text('{"digest": "0000", "sha256": "x", "size": 1}'),
        lambda p: p.write_text(""),
    ],
    ids=["missing", "garbled", "binary", "not-object", "other-key", "empty"],
)
def test_bad_entry_json_is_absent(tmp_path, damage):
    cache = KernelCache(tmp_path)
    key = make_key()
    cache.put(key, PAYLOAD, {})
    _, entry_json = entry_files(cache, key)
    damage(entry_json)
    assert cache.get(key) is None
    assert cache.info()["entries"] == 0
    calls: list = []
    assert cache.get_or_build(key, _builder(PAYLOAD, calls)) == (PAYLOAD, False)
    assert cache.get(key) == PAYLOAD


def test_failing_build_leaves_no_entry(tmp_path):
    cache = KernelCache(tmp_path)
    key = make_key()

    def build() -> bytes:
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get_or_build(key, build)
    assert cache.get(key) is None
    assert not cache.entry_dir(key).exists()
    assert temp_dirs(tmp_path) == []
    assert cache.info()["entries"] == 0
    # The lock was released: the next build goes through.
    assert cache.get_or_build(key, lambda: PAYLOAD) == (PAYLOAD, False)


# -- processes -------------------------------------------------------------------------
# Module-level functions so the "spawn" start method can import them in the child.


def _child_killed_before_publish(root: str) -> None:
    from hipc.cache import store

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    store.os.rename = die  # payload.bin and entry.json are written, the rename never is
    store.KernelCache(Path(root)).put(make_key(), PAYLOAD, {})


def _child_killed_mid_build(root: str) -> None:
    def build() -> bytes:
        os._exit(3)  # dies while holding the key's lock

    KernelCache(Path(root)).get_or_build(make_key(), build)


def _child_get_or_build(root: str, counter: str, lock: bool, start, results) -> None:
    def build() -> bytes:
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.4)  # a slow compile, so the others arrive while it runs
        return PAYLOAD

    start.wait(30)
    data, hit = KernelCache(Path(root), lock=lock).get_or_build(make_key(), build)
    results.put((hashlib.sha256(data).hexdigest(), hit))


def _run_child(target, *args) -> int:
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(30)
    assert not proc.is_alive()
    return proc.exitcode


def test_killed_before_publish_leaves_nothing_that_loads(tmp_path):
    exitcode = _run_child(_child_killed_before_publish, str(tmp_path))
    assert exitcode == -signal.SIGKILL
    cache = KernelCache(tmp_path)
    key = make_key()
    leftovers = temp_dirs(tmp_path)
    assert len(leftovers) == 1  # a complete-looking temp entry, never read
    assert (leftovers[0] / ENTRY_NAME).exists()
    assert cache.get(key) is None
    assert cache.info()["entries"] == 0

    assert cache.sweep_temp() == 0  # too recent for the default age
    assert cache.sweep_temp(older_than_s=0) == 1
    assert temp_dirs(tmp_path) == []
    assert cache.get_or_build(key, lambda: PAYLOAD) == (PAYLOAD, False)


def test_killed_mid_build_leaves_nothing_and_releases_lock(tmp_path):
    assert _run_child(_child_killed_mid_build, str(tmp_path)) == 3
    cache = KernelCache(tmp_path)
    key = make_key()
    assert cache.get(key) is None
    assert temp_dirs(tmp_path) == []
    assert cache.get_or_build(key, lambda: PAYLOAD) == (PAYLOAD, False)


@pytest.mark.parametrize("lock", [True, False], ids=["flock", "no-lock"])
def test_concurrent_processes_same_key(tmp_path, lock):
    ctx = mp.get_context("spawn")
    root = tmp_path / "cache"
    counter = tmp_path / "builds.txt"
    start = ctx.Event()
    results = ctx.Queue()
    n = 4
    procs = [
        ctx.Process(
            target=_child_get_or_build, args=(str(root), str(counter), lock, start, results)
        )
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    start.set()
    got = [results.get(timeout=30) for _ in range(n)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0

    expected = hashlib.sha256(PAYLOAD).hexdigest()
    assert [h for h, _ in got] == [expected] * n
    builds = counter.read_text().split()
    if lock:
        assert len(builds) == 1
        assert sorted(hit for _, hit in got) == [False] + [True] * (n - 1)
    else:
        assert 1 <= len(builds) <= n
    cache = KernelCache(root)
    assert cache.get(make_key()) == PAYLOAD
    assert cache.info()["entries"] == 1
    assert temp_dirs(root) == []


# -- maintenance -----------------------------------------------------------------------


def test_info_evict_clear(tmp_path):
    cache = KernelCache(tmp_path)
    assert cache.info() == {
        "root": str(tmp_path),
        "max_bytes": 10 * 2**30,
        "total_bytes": 0,
        "entries": 0,
        "targets": {},
        "kernel_bytes": 0,
        "artifacts": 0,
        "artifact_bytes": 0,
        "other_bytes": 0,
    }
    keys = {
        "old": make_key(target="sm_90"),
        "mid": make_key(target="sm_90", source="b"),
        "new": make_key(target="gfx1100"),
    }
    for name, key in keys.items():
        cache.put(key, name.encode() * 1000, {"name": name})
    info = cache.info()
    assert info["entries"] == 3
    assert info["targets"] == {"gfx1100": 1, "sm_90": 2}
    assert info["kernel_bytes"] > 9000
    sizes = {
        name: sum(f.stat().st_size for f in cache.entry_dir(k).iterdir())
        for name, k in keys.items()
    }
    assert info["kernel_bytes"] == sum(sizes.values())

    now = time.time()
    for i, name in enumerate(["old", "mid", "new"]):
        t = now - 1000 + i * 100
        os.utime(cache.entry_dir(keys[name]) / ENTRY_NAME, (t, t))
    assert cache.get(keys["old"]) is not None  # a hit makes it the most recently used

    assert cache.evict(info["kernel_bytes"]) == 0
    assert cache.evict(sizes["old"] + sizes["new"]) == 1
    assert cache.get(keys["mid"]) is None
    assert cache.get(keys["old"]) is not None and cache.get(keys["new"]) is not None

    assert cache.clear() == 2
    assert cache.info()["entries"] == 0
    assert cache.get(keys["old"]) is None
    assert cache.clear() == 0


def test_sweep_temp_keeps_entries_and_fresh_temps(tmp_path):
    cache = KernelCache(tmp_path)
    key = make_key()
    cache.put(key, PAYLOAD, {})
    fan = cache.entry_dir(key).parent
    old, fresh = fan / f"{TMP_PREFIX}old", fan / f"{TMP_PREFIX}fresh"
    old.mkdir()
    fresh.mkdir()
    t = time.time() - 7200
    os.utime(old, (t, t))
    assert cache.sweep_temp() == 1
    assert not old.exists() and fresh.exists()
    assert cache.get(key) == PAYLOAD


# -- location and user errors ----------------------------------------------------------


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HIPC_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hipc"

    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hipc"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hipc"

    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert KernelCache().root == tmp_path / "explicit"
    monkeypatch.setenv("HIPC_CACHE_DIR", "~/kc")
    assert default_cache_dir() == tmp_path / "home" / "kc"


@pytest.mark.parametrize("sub", ["", "below"], ids=["root-is-file", "parent-is-file"])
def test_unusable_root_raises_hipc_error(tmp_path, sub):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    root = blocker / sub if sub else blocker
    cache = KernelCache(root)
    key = make_key()
    assert cache.get(key) is None  # reading just misses

    with pytest.raises(HipcError) as err:
        cache.put(key, PAYLOAD, {})
    message = str(err.value)
    assert str(root) in message and "\n" not in message

    def build() -> bytes:
        pytest.fail("must fail before building")

    with pytest.raises(HipcError, match="not-a-dir"):
        cache.get_or_build(key, build)
    assert blocker.read_text() == "x"


def fake_artifact(cache: KernelCache, key: str, nbytes: int, age_s: float) -> Path:
    """A cached artifact folder as compiler/cached.py lays it out, `nbytes` of files."""
    folder = cache.artifact_dir(key)
    (folder / "model.hipc" / "kernels").mkdir(parents=True)
    (folder / "model.hipc" / "weights.safetensors").write_bytes(b"w" * (nbytes - 100))
    (folder / "model.hipc" / "kernels" / "cpu.so").write_bytes(b"k" * 100)
    t = time.time() - age_s
    os.utime(folder, (t, t))
    return folder


def test_info_counts_cached_artifacts_and_everything_on_disk(tmp_path):
    cache = KernelCache(tmp_path)
    cache.put(make_key(), PAYLOAD, {})
    fake_artifact(cache, "a" * 24, 190_000, 0)
    fake_artifact(cache, "b" * 24, 50_000, 0)
    (tmp_path / "verified").mkdir()
    (tmp_path / "verified" / "stamp").write_bytes(b"s" * 30)
    info = cache.info()
    assert info["entries"] == 1 and info["artifacts"] == 2
    assert info["artifact_bytes"] == 240_000
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert info["total_bytes"] == on_disk
    assert info["other_bytes"] == on_disk - info["kernel_bytes"] - 240_000 >= 30


def test_clear_artifacts_leaves_kernels_to_clear(tmp_path):
    cache = KernelCache(tmp_path)
    cache.put(make_key(), PAYLOAD, {})
    fake_artifact(cache, "a" * 24, 1000, 0)
    assert cache.clear_artifacts() == 1
    assert cache.info()["artifacts"] == 0 and cache.get(make_key()) == PAYLOAD
    assert list((tmp_path / "artifacts").iterdir()) == []


def test_lru_bound_spans_kernels_and_artifacts(tmp_path):
    cache = KernelCache(tmp_path)
    key = make_key()
    cache.put(key, b"x" * 10_000, {})
    entry = cache.entry_dir(key)
    kernel = sum(f.stat().st_size for f in entry.iterdir())
    t = time.time() - 500
    os.utime(entry / ENTRY_NAME, (t, t))
    oldest = fake_artifact(cache, "o" * 24, 20_000, 1000)
    newest = fake_artifact(cache, "n" * 24, 20_000, 10)
    kept = fake_artifact(cache, "k" * 24, 20_000, 2000)  # oldest of all, but in use
    # the bound leaves room for two artifacts: the oldest unkept artifact, then the
    # kernel (used 500 s ago) go; the newest and the kept one stay
    assert cache.evict(40_000, keep=[kept / "model.hipc"]) == 2
    assert not oldest.exists() and cache.get(key) is None
    assert newest.exists() and kept.exists()
    assert cache.evict(40_000 + kernel) == 0
    # a reused artifact becomes the most recent: the other one goes first
    cache.mark_used(kept)
    assert cache.evict(20_000) == 1
    assert kept.exists() and not newest.exists()


def test_an_artifact_being_compiled_is_neither_evicted_nor_cleared(tmp_path):
    import subprocess
    import sys

    cache = KernelCache(tmp_path)
    busy = fake_artifact(cache, "b" * 24, 5000, 1000)
    (busy / f".model.hipc.tmp-{os.getpid()}").mkdir()  # this process is "compiling" into it
    dead = fake_artifact(cache, "d" * 24, 5000, 2000)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    (dead / f".model.hipc.tmp-{int(gone.stdout)}").mkdir()  # a killed compile's leftover
    assert cache.evict(0) == 1
    assert busy.exists() and not dead.exists()
    assert cache.clear_artifacts() == 0 and busy.exists()
    (busy / f".model.hipc.tmp-{os.getpid()}").rmdir()
    assert cache.clear_artifacts() == 1 and not busy.exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", 10 * 2**30),
        ("5000", 5000),
        ("500M", 500 * 2**20),
        ("1.5g", 3 * 2**29),
        ("2GiB", 2 * 2**30),
        ("0", None),
    ],
)
def test_max_bytes_from_env(monkeypatch, value, expected):
    from hipc.cache import max_bytes_from_env

    monkeypatch.setenv("HIPC_CACHE_MAX_BYTES", value)
    assert max_bytes_from_env() == expected


def test_bad_max_bytes_is_one_line(monkeypatch, tmp_path, capsys):
    from hipc.cli.main import main

    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HIPC_CACHE_MAX_BYTES", "lots")
    assert main(["cache", "info"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hipc: error: HIPC_CACHE_MAX_BYTES='lots'") and "\n" not in err


def test_cache_command_counts_and_clears_artifacts(monkeypatch, tmp_path, capsys):
    from hipc.cli.main import main

    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HIPC_CACHE_MAX_BYTES", "64M")
    cache = KernelCache(tmp_path)
    cache.put(make_key(), PAYLOAD, {})
    fake_artifact(cache, "a" * 24, 3 * 2**20, 0)
    (cache.entry_dir(make_key()).parent / f"{TMP_PREFIX}left-by-a-killed-build").mkdir()
    assert main(["cache", "info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["artifacts"] == 1 and info["entries"] == 1 and info["max_bytes"] == 64 * 2**20
    assert info["total_bytes"] > 3 * 2**20
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 kernels and 1 cached artifacts (3.0 MiB)" in out
    assert [f for f in tmp_path.rglob("*") if f.is_file()] == []
