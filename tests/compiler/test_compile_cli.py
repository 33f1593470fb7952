"""hipc compile end to end: cache behaviour, atomicity, bad input, and a runtime without the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hipc.cache import KernelCache
from hipc.cli.main import main

from support import write_tiny_hf


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_hf(tmp_path / "tiny")


def hipc(*args, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "hipc.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        **kw,
    )


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hipc: error: ")
    for n in needles:
        assert n in last, last


def test_second_compile_is_a_fast_cache_hit(tiny, tmp_path, capsys, monkeypatch):
    # a cache of its own: the session's may already hold this model's kernels
    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["compile", str(tiny), "-o", str(tmp_path / "a.hipc"), "-q"]) == 0
    assert "compiled" in capsys.readouterr().err
    t0 = time.perf_counter()
    assert main(["compile", str(tiny), "-o", str(tmp_path / "b.hipc"), "-q"]) == 0
    assert time.perf_counter() - t0 < 10
    assert "cache hit" in capsys.readouterr().err
    a = (tmp_path / "a.hipc" / "kernels" / "cpu.so").read_bytes()
    assert a == (tmp_path / "b.hipc" / "kernels" / "cpu.so").read_bytes()


def test_corrupt_cache_entry_is_rebuilt(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["compile", str(tiny), "-o", str(tmp_path / "a.hipc"), "-q"]) == 0
    cache = KernelCache()
    payloads = list(cache.root.rglob("payload.bin"))
    assert payloads
    for p in payloads:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data[: len(data) - 100]))
    capsys.readouterr()
    assert main(["compile", str(tiny), "-o", str(tmp_path / "b.hipc"), "-q"]) == 0
    assert "compiled" in capsys.readouterr().err  # not a hit: the damaged entry was rebuilt
    assert (
        main(
            [
                "logits",
                str(tmp_path / "b.hipc"),
                "--tokens",
                "1,2,3",
                "--out",
                str(tmp_path / "l.npy"),
            ]
        )
        == 0
    )
    assert np.isfinite(np.load(tmp_path / "l.npy")).all()


def test_compile_killed_midway_leaves_nothing_that_loads(tiny, tmp_path):
    slow = tmp_path / "slow-cxx"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    out = tmp_path / "k.hipc"
    entries = KernelCache().info()["entries"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hipc.cli.main", "compile", str(tiny), "-o", str(out)],
        env={**os.environ, "CXX": str(slow)},
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and "compile cpu" not in proc.stderr.readline():
        pass
    proc.kill()
    proc.wait()
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".k.hipc")]
    assert KernelCache().info()["entries"] == entries
    # the same compile then succeeds with the real compiler
    assert hipc("compile", tiny, "-o", out, "-q").returncode == 0
    assert (out / "manifest.json").is_file()


def test_two_concurrent_compiles_both_succeed(tmp_path):
    folder = write_tiny_hf(tmp_path / "m", seed=7, intermediate_size=80)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hipc.cli.main",
                "compile",
                str(folder),
                "-o",
                str(tmp_path / f"{i}.hipc"),
                "-q",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    for i in range(2):
        assert (
            hipc(
                "logits", tmp_path / f"{i}.hipc", "--tokens", "1,2", "--out", tmp_path / f"{i}.npy"
            ).returncode
            == 0
        )
    np.testing.assert_array_equal(np.load(tmp_path / "0.npy"), np.load(tmp_path / "1.npy"))


def test_unknown_target(tiny, tmp_path):
    one_line_error(
        hipc("compile", tiny, "--target", "gfx9999", "-o", tmp_path / "x.hipc"),
        "gfx9999",
        "--target",
    )
    assert not (tmp_path / "x.hipc").exists()


def test_manifest_sizes_and_checksums_match_the_files(tiny, tmp_path):
    import hashlib

    out = tmp_path / "a.hipc"
    assert main(["compile", str(tiny), "-o", str(out), "-q"]) == 0
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert "weights.safetensors" in files and "plan.json" in files
    for name, rec in files.items():
        data = (out / name).read_bytes()
        assert rec == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_bfloat16_kv_cache_on_the_cpu_target(tiny, tmp_path):
    one_line_error(
        hipc("compile", tiny, "--kv-storage", "bfloat16", "-o", tmp_path / "x.hipc"),
        "--kv-storage bfloat16",
        "cpu target",
    )
    assert not (tmp_path / "x.hipc").exists()


def test_kv_storage_and_context_defaults():
    from hipc.compiler.options import CompileOptions

    assert CompileOptions().resolved_kv_storage() == "float32"
    assert CompileOptions(targets=("sm_90", "gfx942")).resolved_kv_storage() == "bfloat16"
    assert CompileOptions(targets=("cpu", "sm_90")).resolved_kv_storage() == "float32"
    assert CompileOptions(targets=("sm_90",), kv_storage="float32").resolved_kv_storage() == (
        "float32"
    )
    # the cpu target caps its context; GPU targets compile the model's whole context
    assert CompileOptions().resolved_max_context(131072) == 4096
    assert CompileOptions(targets=("sm_90",)).resolved_max_context(131072) == 131072
    assert CompileOptions(targets=("sm_90",), max_context=2048).resolved_max_context(8192) == 2048
    # a hybrid with KV in 1 layer of 4 gets the positions the same KV memory holds
    assert CompileOptions().resolved_max_context(262144, 0.25) == 16384
    assert CompileOptions().resolved_max_context(8192, 0.25) == 8192
    assert CompileOptions(max_context=1000).resolved_max_context(262144, 0.25) == 1000


def test_unwritable_output_path(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_line_error(hipc("compile", tiny, "-o", blocker / "x.hipc"), "-o")
    one_line_error(hipc("compile", tiny, "-o", blocker), "not a hipc artifact")
    assert blocker.read_text() == "x"


def test_failing_compiler_shows_its_error(tiny, tmp_path):
    bad = tmp_path / "bad-cxx"
    bad.write_text("#!/bin/sh\necho 'program.cpp:1:1: error: the compiler says boom' >&2\nexit 1\n")
    bad.chmod(0o755)
    proc = hipc("compile", tiny, "-o", tmp_path / "x.hipc", env={"CXX": str(bad)})
    one_line_error(proc, "C++ compiler failed", "boom")
    assert not (tmp_path / "x.hipc").exists()


def test_artifact_from_another_format_version(tiny, tmp_path):
    out = tmp_path / "a.hipc"
    assert hipc("compile", tiny, "-o", out, "-q").returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format_version"] = 999
    (out / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(
        hipc("logits", out, "--tokens", "1", "--out", tmp_path / "l.npy"),
        "manifest.json",
        "version 999",
    )


def test_truncated_weights_file(tiny, tmp_path):
    out = tmp_path / "a.hipc"
    assert hipc("compile", tiny, "-o", out, "-q").returncode == 0
    weights = out / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    one_line_error(hipc("generate", out, "--prompt", "x"), "weights.safetensors")
    one_line_error(
        hipc("logits", out, "--tokens", "1", "--out", tmp_path / "l.npy"), "weights.safetensors"
    )
    assert not (tmp_path / "l.npy").exists()


def test_missing_code_object(tiny, tmp_path):
    out = tmp_path / "a.hipc"
    assert hipc("compile", tiny, "-o", out, "-q").returncode == 0
    (out / "kernels" / "cpu.so").unlink()
    one_line_error(
        hipc("logits", out, "--tokens", "1", "--out", tmp_path / "l.npy"), "cpu.so", "missing"
    )


def test_runtime_imports_no_compiler_and_no_jinja(tiny, tmp_path):
    out = tmp_path / "a.hipc"
    assert hipc("compile", tiny, "-o", out, "-q").returncode == 0
    code = (
        "import sys\n"
        "from hipc.runtime.engine import load_engine\n"
        f"e = load_engine({str(out)!r})\n"
        "assert e.logits([1, 2, 3]).shape == (3, 97)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('hipc.compiler', 'hipc.graphs', 'jinja2', 'gguf')))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_explain_and_dump(tiny, tmp_path, capsys):
    dump = tmp_path / "dump"
    assert (
        main(
            [
                "compile",
                str(tiny),
                "-o",
                str(tmp_path / "a.hipc"),
                "--explain",
                "--dump",
                str(dump),
                "-q",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "kernels from" in out and "refused" in out and "epilogue:glu" in out
    assert "already fused into" in out  # the residual Add went to the Linear, not the next norm
    names = {p.name for p in dump.iterdir()}
    assert {
        "0-built.graph.json",
        "1-canonical.graph.json",
        "2-repacked.graph.json",
        "3-fusion.txt",
        "4-memory.json",
        "5-kernels.json",
        "6-cpu.cpp",
        "7-plan.json",
    } <= names
    source = (dump / "6-cpu.cpp").read_text()
    assert "// l0.q+k+v: l0.attn_norm, l0.q+k+v, l0.q+k+v.split" in source
    # the memory plan and the launch plan as the artifact has them
    memory = json.loads((dump / "4-memory.json").read_text())
    plan = json.loads((tmp_path / "a.hipc" / "plan.json").read_text())
    assert memory == plan["memory"] and json.loads((dump / "7-plan.json").read_text()) == plan


def test_every_dumped_onnx_passes_the_checker(tiny, tmp_path):
    onnx = pytest.importorskip("onnx")
    dump = tmp_path / "dump"
    assert (
        main(["compile", str(tiny), "-o", str(tmp_path / "a.hipc"), "--dump", str(dump), "-q"]) == 0
    )
    stages = sorted(p.name for p in dump.glob("*.onnx"))
    assert stages == ["0-built.onnx", "1-canonical.onnx", "2-repacked.onnx"]
    for name in stages:
        model = onnx.load(str(dump / name))
        onnx.checker.check_model(model, full_check=True)  # shape inference too
        graph = json.loads((dump / name.replace(".onnx", ".graph.json")).read_text())
        ops = {n["op"].split("::")[-1] for n in graph["nodes"]}
        # every IR op is in the file (the export adds standard wrapping nodes, drops none)
        assert ops <= {n.op_type for n in model.graph.node}, name


def test_verify_command(tiny, capsys):
    assert main(["verify", str(tiny), "--max-context", "64"]) == 0
    assert "PASS" in capsys.readouterr().out
    # an impossible tolerance must fail: the check is real
    assert main(["verify", str(tiny), "--max-context", "64", "--rtol", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_compiles_keep_the_cache_within_its_bound(tmp_path, monkeypatch, capsys):
    from hipc.cache.store import TMP_PREFIX

    monkeypatch.setenv("HIPC_CACHE_DIR", str(tmp_path / "cache"))
    cache = KernelCache()
    a = write_tiny_hf(tmp_path / "a", seed=1)
    b = write_tiny_hf(tmp_path / "b", seed=2, intermediate_size=80)  # another kernel source
    assert main(["compile", str(a), "-o", str(tmp_path / "a.hipc"), "-q"]) == 0
    (entry_a,) = [p.parent for p in cache.root.rglob("entry.json")]
    one = cache.info()["kernel_bytes"]
    stale = entry_a.parent / f"{TMP_PREFIX}killed-build"
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    old = time.time() - 60
    os.utime(entry_a / "entry.json", (old, old))
    capsys.readouterr()

    monkeypatch.setenv("HIPC_CACHE_MAX_BYTES", str(int(one * 1.5)))
    assert main(["compile", str(b), "-o", str(tmp_path / "b.hipc"), "-q"]) == 0
    assert "removed 1 least recently used entries" in capsys.readouterr().err
    assert not entry_a.exists() and not stale.exists()
    assert cache.info()["entries"] == 1
    assert (tmp_path / "a.hipc" / "kernels" / "cpu.so").is_file()  # artifacts are copies

    # a raw model compiled on demand lands in the cache; a bound smaller than it keeps it
    monkeypatch.setenv("HIPC_CACHE_MAX_BYTES", "1")
    logits = ["logits", str(a), "--tokens", "1,2", "--out", str(tmp_path / "l.npy")]
    assert main(logits) == 0
    assert "compiling" in capsys.readouterr().err
    assert cache.info()["artifacts"] == 1 and cache.info()["entries"] == 0
    assert main(logits) == 0
    assert "compiling" not in capsys.readouterr().err  # reused, not rebuilt


def test_cpu_backend_bounds_the_barrier_spin_unless_the_user_chose(tiny, tmp_path):
    out = tmp_path / "a.hipc"
    assert hipc("compile", tiny, "-o", out, "-q").returncode == 0
    code = (
        "import os\n"
        "from hipc.runtime.engine import load_engine\n"
        f"load_engine({str(out)!r}).logits([1, 2])\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def spin(**env):
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env}
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert spin() == "1000"
    assert spin(OMP_WAIT_POLICY="active") == "None"  # the user's choice stands
    assert spin(GOMP_SPINCOUNT="5") == "5"
