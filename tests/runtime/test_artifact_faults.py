"""Fault injection on artifacts, the kernel cache and compiles (issue 16, findings 7-10).

Every fault either works or fails with one line naming the file, exit status 2, no
traceback; nothing partial is ever loadable; what a killed compile leaves is swept by the
next compile and by `hipc cache clear`. Commands that could crash run in a subprocess, so
a crash is a failed assertion, not a dead test run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hipc.base.errors import HipcError
from hipc.cli.main import main
from hipc.runtime.artifact import load_artifact

from support import write_tiny_chat_model

CLI = [sys.executable, "-m", "hipc.cli.main"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("src") / "tiny", max_context=64)


@pytest.fixture(scope="module")
def built(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built") / "tiny.hipc"
    assert main(["compile", str(source), "-o", str(out), "-q"]) == 0
    return out


@pytest.fixture
def art(built, tmp_path) -> Path:
    copy = tmp_path / "tiny.hipc"
    shutil.copytree(built, copy)
    return copy


def cli(*argv, env=None, timeout=300) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        [*CLI, *map(str, argv)], capture_output=True, text=True, env=full, timeout=timeout
    )


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hipc: error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x20
    path.write_bytes(bytes(data))


def rehash(art: Path) -> None:
    """Make the manifest agree with the files again: a consistent edit, or a compiler bug."""
    manifest = json.loads((art / "manifest.json").read_text())
    for rel, info in manifest["files"].items():
        data = (art / rel).read_bytes()
        info["size"], info["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest, indent=1))


def generate(art: Path, **env) -> subprocess.CompletedProcess:
    return cli("generate", art, "--prompt", "Hello", "--max-tokens", "2", env=env)


# ------------------------------------------------------------------ 7. every file's bytes


def listed(built: Path) -> list[str]:
    return sorted(json.loads((built / "manifest.json").read_text())["files"])


def test_a_clean_artifact_runs(art):
    proc = generate(art)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("at", ["start", "middle", "end"])
def test_every_flipped_file_is_refused_naming_it(built, tmp_path, at):
    for rel in listed(built):
        art = tmp_path / f"{rel.replace('/', '_')}-{at}.hipc"
        shutil.copytree(built, art)
        size = (art / rel).stat().st_size
        flip(art / rel, {"start": 0, "middle": size // 2, "end": size - 1}[at])
        with pytest.raises(HipcError, match=re.escape(f"{art / rel}: contents differ")):
            load_artifact(art)
        assert_one_line(generate(art), rel)


def test_one_bit_per_4k_in_the_weights_is_refused(art):
    data = bytearray((art / "weights.safetensors").read_bytes())
    for i in range(100, len(data), 4096):
        data[i] ^= 1
    (art / "weights.safetensors").write_bytes(bytes(data))
    assert_one_line(generate(art), "weights.safetensors", "differ")


def test_a_stamp_does_not_hide_a_later_edit(art, tmp_path, monkeypatch):
    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path / "cache"))
    load_artifact(art)  # verified: stamped
    stamps = list((tmp_path / "cache" / "verified").iterdir())
    assert len(stamps) == 1
    weights = art / "weights.safetensors"
    before = weights.stat()
    flip(weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back
    with pytest.raises(HipcError, match=r"weights\.safetensors: contents differ"):
        load_artifact(art)


def test_a_stamp_skips_the_hashing_and_always_ignores_it(art, tmp_path, monkeypatch):
    import hipc.runtime.integrity as integrity

    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path / "cache"))
    hashed = []
    real = integrity._sha256
    monkeypatch.setattr(integrity, "_sha256", lambda p: hashed.append(p.name) or real(p))
    load_artifact(art)
    assert "weights.safetensors" in hashed
    hashed.clear()
    load_artifact(art)
    assert hashed == []
    monkeypatch.setenv("HIPC_VERIFY", "always")
    load_artifact(art)
    assert "weights.safetensors" in hashed


def test_unwritable_cache_still_verifies_every_time(art, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HIPC_CACHE_DIR", str(blocker / "cache"))  # mkdir fails: ENOTDIR
    load_artifact(art)
    flip(art / "plan.json")
    with pytest.raises(HipcError, match=r"plan\.json: contents differ"):
        load_artifact(art)


# ------------------------------------------------------------------ 8. the plan


def edit_plan(art: Path, change) -> None:
    plan = json.loads((art / "plan.json").read_text())
    change(plan)
    (art / "plan.json").write_text(json.dumps(plan))


PLAN_EDITS = {
    "max_tokens": (lambda p: p.update(max_tokens=p["max_tokens"] // 2), "max_tokens"),
    "vocab_size": (lambda p: p.update(vocab_size=p["vocab_size"] - 100), "vocab_size"),
    "kv positions": (
        lambda p: [s.update(shape=[s["shape"][0] // 2, *s["shape"][1:]]) for s in p["states"]],
        "max_context",
    ),
    "kv heads": (
        lambda p: [s.update(shape=[*s["shape"][:2], s["shape"][2] // 2]) for s in p["states"]],
        "attention kernel",
    ),
    "weight shape": (
        lambda p: p["weights"][1].update(stored_shape=[p["weights"][1]["stored_shape"][0] - 1]),
        "weights.safetensors holds",
    ),
    "unknown kernel": (lambda p: p["groups"][0].update(kernel="nope"), "not in plan.kernels"),
    "unknown state": (
        lambda p: next(
            a.update(ref="kv.99.k")
            for launch in p["groups"]
            for a in launch["args"].values()
            if a["kind"] == "state"
        ),
        "kv.99.k",
    ),
    "not an object": (lambda p: p.update(weights=7), "weights"),
}


@pytest.mark.parametrize("name", sorted(PLAN_EDITS))
def test_plan_edits_are_refused_before_anything_runs(art, name):
    change, needle = PLAN_EDITS[name]
    edit_plan(art, change)
    assert_one_line(generate(art), "plan.json")  # the manifest catches it (size or hash)
    rehash(art)  # and a manifest that agrees does not make the plan right
    assert_one_line(generate(art), "plan.json", needle)


# ------------------------------------------------------------------ 9. one line, not a traceback


def test_tokenizer_not_utf8_is_one_line_at_generate_and_serve(art):
    (art / "tokenizer.json").write_bytes(b"\xff\xfe" + (art / "tokenizer.json").read_bytes()[2:])
    rehash(art)
    assert_one_line(generate(art), "tokenizer.json", "UTF-8")
    proc = cli("serve", art, "--port", "0", "--no-eager-load", timeout=60)
    assert_one_line(proc, "tokenizer.json", "UTF-8")


@pytest.mark.parametrize("what", ["garbage", "another library"])
def test_wrong_code_object_even_with_a_matching_manifest(art, what):
    import ctypes.util

    so = art / "kernels" / "cpu.so"
    if what == "garbage":
        so.write_bytes(b"\x7fELF" + os.urandom(4096))
    else:
        ctypes.CDLL(ctypes.util.find_library("m"))  # mapped: its path is in /proc/self/maps
        maps = Path("/proc/self/maps").read_text().split()
        found = [p for p in maps if "/libm" in p and ".so" in p]
        if not found:
            pytest.skip("no libm to stand in for a code object")
        shutil.copyfile(found[0], so)
    rehash(art)
    assert_one_line(generate(art), "cpu.so")


def test_source_tokenizer_not_utf8_is_one_line_at_compile(source, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    data = (bad / "tokenizer.json").read_bytes()
    (bad / "tokenizer.json").write_bytes(b"\xff\xfe" + data[2:])
    proc = cli("compile", bad, "-o", tmp_path / "bad.hipc", "-q")
    assert_one_line(proc, "tokenizer.json", "UTF-8")


def test_code_object_not_in_the_file_list(art):
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["targets"]["cpu"]["code_object"] = "kernels/elsewhere.so"
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line(generate(art), "manifest.json", "kernels/elsewhere.so")


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.pop("files"),
        lambda m: m["files"].update({"../../etc/passwd": {"size": 1, "sha256": "0"}}),
        lambda m: m["files"]["plan.json"].update(size="big"),
        lambda m: m.update(targets=[]),
        lambda m: m["files"].pop("weights.safetensors"),
    ],
    ids=["no files", "path outside", "size not int", "targets not object", "weights unlisted"],
)
def test_malformed_manifest_is_one_line(art, edit):
    manifest = json.loads((art / "manifest.json").read_text())
    edit(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line(generate(art), "manifest.json")


def test_full_disk_at_compile_is_one_line_and_leaves_nothing(source, tmp_path, monkeypatch, capsys):
    import hipc.compiler.artifact as writer

    def full(path, *a, **k):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "write_safetensors", full)
    out = tmp_path / "out" / "tiny.hipc"
    out.parent.mkdir()
    assert main(["compile", str(source), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "tiny.hipc" in err[0], err
    assert list(out.parent.iterdir()) == []


def test_full_disk_keeps_the_old_artifact(built, source, tmp_path, monkeypatch, capsys):
    import hipc.compiler.artifact as writer

    out = tmp_path / "tiny.hipc"
    shutil.copytree(built, out)
    monkeypatch.setattr(
        writer, "_write_json", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    )
    assert main(["compile", str(source), "-o", str(out), "-q"]) == 2
    assert "full" in capsys.readouterr().err
    load_artifact(out)  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.hipc"]


def test_read_only_output_folder_is_one_line(source, tmp_path, monkeypatch, capsys):
    real_mkdir = Path.mkdir

    def refuse(self, *a, **k):
        if self.name.startswith(".tiny.hipc.tmp-"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert main(["compile", str(source), "-o", str(tmp_path / "tiny.hipc"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Permission denied" in err[0], err


def test_read_only_artifact_loads_and_runs(art, tmp_path):
    # as root chmod does not stop writes, but it shows loading never needs to write there
    for p in [art, *art.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        assert generate(art, HIPC_CACHE_DIR=str(tmp_path / "cache")).returncode == 0
    finally:
        for p in [art, *art.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_corrupt_kernel_cache_files_are_rebuilt(source, tmp_path):
    env = {"HIPC_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "a.hipc"
    assert cli("compile", source, "-o", out, "-q", env=env).returncode == 0
    cache_files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert any(p.name == "payload.bin" for p in cache_files)
    for p in cache_files:
        if p.stat().st_size:
            flip(p)
    proc = cli("compile", source, "-o", out, "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    assert generate(out, **env).returncode == 0


# ------------------------------------------------------------------ 10. killed compiles

# Each stage's hook kills the compile (SIGKILL: no cleanup runs) at that point.
KILL_AT = {
    "toolchain": (
        "import hipc.compiler.toolchains.cpu as m; real = m.subprocess.run\n"
        "m.subprocess.run = lambda cmd, *a, **k: die() if '-o' in cmd else real(cmd, *a, **k)"
    ),
    "weights": (
        "import hipc.compiler.artifact as m; real = m.write_safetensors\n"
        "def w(path, *a, **k):\n    path.write_bytes(b'x' * 4096); die()\n"
        "m.write_safetensors = w"
    ),
    "manifest": (
        "import hipc.compiler.artifact as m; real = m._write_json\n"
        "m._write_json = lambda p, o: die() if p.name == 'manifest.json' else real(p, o)"
    ),
    "swap": (
        "import hipc.compiler.scratch as m; real = m._exchange\n"
        "m._exchange = lambda a, b: real(a, b) and die()"
    ),
}
DRIVER = """
import os, signal, sys
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
{hook}
from hipc.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def leftovers(folder: Path, tmpdir: Path) -> list[str]:
    names = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    return names + [p.name for p in tmpdir.iterdir() if p.name.startswith("hipc-")]


def killed_compile(stage: str, source: Path, out: Path, env: dict) -> None:
    code = DRIVER.format(hook=KILL_AT[stage])
    proc = subprocess.run(
        [sys.executable, "-c", code, "compile", str(source), "-o", str(out), "-q"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-1000:])


@pytest.mark.parametrize("sweeper", ["next compile", "cache clear"])
@pytest.mark.parametrize("stage", sorted(KILL_AT))
def test_killed_compile_leaves_old_or_new_and_is_swept(built, source, tmp_path, stage, sweeper):
    folder, tmpdir = tmp_path / "out", tmp_path / "tmp"
    folder.mkdir()
    tmpdir.mkdir()
    env = {"HIPC_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmpdir)}
    out = folder / "tiny.hipc"
    shutil.copytree(built, out)
    old_manifest = (out / "manifest.json").read_bytes()
    killed_compile(stage, source, out, env)

    # -o holds a whole artifact: the old one, or (killed after the swap) the new one
    load_artifact(out)
    if stage != "swap":
        assert (out / "manifest.json").read_bytes() == old_manifest
    left = leftovers(folder, tmpdir)
    assert left, f"the {stage} hook left nothing: it did not run"

    if sweeper == "next compile":
        proc = cli("compile", source, "-o", out, "-q", env=env)
    else:
        proc = cli("cache", "clear", env=env)
    assert proc.returncode == 0, proc.stderr
    assert leftovers(folder, tmpdir) == []
    load_artifact(out)


def test_concurrent_compiles_to_one_output_both_succeed(source, tmp_path):
    env = {"HIPC_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "tiny.hipc"
    assert cli("compile", source, "-o", out, "-q", env=env).returncode == 0  # warm the cache
    procs = [
        subprocess.Popen(
            [*CLI, "compile", str(source), "-o", str(out), "-q"],
            env={**os.environ, **env},
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    load_artifact(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "tiny.hipc"]


def test_corrupt_cached_artifact_is_rebuilt(source, tmp_path):
    """`hipc generate RAW_MODEL` compiles into the cache; a damaged copy there is rebuilt."""
    env = {"HIPC_CACHE_DIR": str(tmp_path / "cache")}
    first = cli("generate", source, "--prompt", "Hello", "--max-tokens", "3", env=env)
    assert first.returncode == 0, first.stderr
    (cached,) = (tmp_path / "cache" / "artifacts").glob("*/model.hipc")
    flip(cached / "weights.safetensors")
    again = cli("generate", source, "--prompt", "Hello", "--max-tokens", "3", env=env)
    assert again.returncode == 0, again.stderr
    assert "rebuilding damaged cached artifact" in again.stderr
    assert again.stdout == first.stdout
    load_artifact(cached)


def test_failed_cached_compile_leaves_no_entry(source, tmp_path, monkeypatch):
    """`hipc generate RAW_MODEL` whose compile fails (a weight type without a kernel, say)
    leaves no empty entry folder in the cache."""
    import hipc.compiler.pipeline as pipeline
    from hipc.compiler.cached import cached_artifact
    from hipc.compiler.options import CompileOptions

    def refuse(*_args, **_kwargs):
        raise HipcError("w: weight type tq2_0 has no CPU kernel")

    monkeypatch.setattr(pipeline, "compile_model", refuse)
    with pytest.raises(HipcError, match="tq2_0"):
        cached_artifact(str(source), CompileOptions(), root=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "artifacts").iterdir())


def test_garbage_in_the_cache_folder_is_no_traceback(tmp_path):
    cache = tmp_path / "cache"
    (cache / "pending").mkdir(parents=True)
    (cache / "pending" / "1-x.json").write_bytes(b"\xff not json")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    record = {"pid": int(dead.stdout), "path": str(tmp_path / "keep")}  # not a scratch name
    (tmp_path / "keep").mkdir()
    (cache / "pending" / "2-y.json").write_text(json.dumps(record))
    (cache / "verified").mkdir()
    (cache / "verified" / "junk").write_bytes(b"\0" * 10)
    proc = cli("cache", "clear", env={"HIPC_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "keep").is_dir()
    assert not list((cache / "pending").iterdir())


@pytest.fixture(scope="module")
def gpu_built(source, tmp_path_factory) -> Path:
    """The tiny model for an AMD target, cross-compiled (no GPU needed to load its plan)."""
    if shutil.which("clang++-19") is None and shutil.which("hipcc") is None:
        pytest.skip("no AMD toolchain (clang++-19 or hipcc)")
    out = tmp_path_factory.mktemp("gpu") / "tiny.hipc"
    assert main(["compile", str(source), "-o", str(out), "--target", "gfx1100", "-q"]) == 0
    return out


GPU_PLAN_EDITS = {
    "no section": (lambda p: p["targets"].pop("gfx1100"), "no targets.gfx1100 launch plan"),
    "weight index": (
        lambda p: next(
            a.update(index=999)
            for launch in p["targets"]["gfx1100"]["steps"]["decode"]
            for a in launch["args"]
            if a["kind"] == "weight"
        ),
        "names weight 999",
    ),
    "state index": (
        lambda p: next(
            a.update(index=-1)
            for launch in p["targets"]["gfx1100"]["steps"]["prefill"]
            for a in launch["args"]
            if a["kind"] == "state"
        ),
        "names state -1",
    ),
}


@pytest.mark.parametrize("name", sorted(GPU_PLAN_EDITS))
def test_gpu_plan_edits_are_refused_at_load(gpu_built, tmp_path, name):
    art = tmp_path / "gpu.hipc"
    shutil.copytree(gpu_built, art)
    load_artifact(art)  # as compiled: consistent
    change, needle = GPU_PLAN_EDITS[name]
    edit_plan(art, change)
    rehash(art)
    with pytest.raises(HipcError, match=re.escape(needle)):
        load_artifact(art)
