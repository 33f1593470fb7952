"""Before an artifact runs: its bytes are the ones the compiler wrote, and its plan agrees
with the weights and kernels it describes.

`verify_files` checks every file the manifest lists against its size and sha256. Hashing
costs about 0.3 s per 100 MB, so a verified artifact is stamped: a small file under
`$HIPC_CACHE_DIR/verified/` named by a hash of the manifest and every listed file's
(size, mtime, ctime, inode, device). Any write to a file changes its ctime, which no tool
can set back, so a stamped artifact whose bytes were edited since is hashed again (and
refused). A stamp cannot notice bits that rot on the disk under an unchanged inode;
`HIPC_VERIFY=always` hashes on every load. Where the cache directory cannot be written the
artifact is simply hashed every time.

`check_plan` checks plan.json against the weights file's header and against itself
(kernels named by launches exist, state shapes agree with the attention kernels and the
context, vocabulary sizes agree), so that a plan that does not describe its code object
and weights is one clear error, never a kernel writing out of bounds. It reads launch plan
version 3 (hipc.base.launch_plan, which checks the format and version first): weights,
states by kind, memory, kernels, groups (the kernel selection) and targets.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from hipc.base.errors import HipcError
from hipc.base.launch_plan import MAX_STEP_TOKENS

_CHUNK = 1 << 22
STATE_DTYPES = ("float32", "bfloat16")
PLAIN_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8"}
PLAIN_DTYPES |= {"uint8", "uint16", "bool"}


# ------------------------------------------------------------------ files


def listed_files(path: Path, manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """manifest["files"], each entry checked for shape and for staying inside the artifact."""
    where = path / "manifest.json"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise HipcError(f"{where}: 'files' is missing or not an object")
    for rel, info in files.items():
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise HipcError(f"{where}: file name {rel!r} is not a path inside the artifact")
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("size"), int)
            or not isinstance(info.get("sha256"), str)
        ):
            raise HipcError(f"{where}: files[{rel!r}] needs an integer 'size' and a 'sha256'")
    return files


def verify_files(path: Path, manifest: Mapping[str, Any], manifest_bytes: bytes) -> None:
    """Every listed file is there with its size and sha256, or one HipcError naming it."""
    files = listed_files(path, manifest)
    stats = {}
    for rel, info in files.items():
        f = path / rel
        try:
            st = f.stat()
        except FileNotFoundError:
            raise HipcError(f"{f}: missing from the artifact") from None
        except OSError as e:
            raise HipcError(f"{f}: cannot read ({e.strerror})") from None
        if not f.is_file():
            raise HipcError(f"{f}: not a regular file")
        if st.st_size != info["size"]:
            raise HipcError(
                f"{f}: size {st.st_size} bytes, the manifest says {info['size']} "
                "(truncated or replaced)"
            )
        stats[rel] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    stamp = _stamp_path(path, manifest_bytes, stats)
    if stamp is not None and stamp.is_file() and os.environ.get("HIPC_VERIFY") != "always":
        return
    # NOTE: hashlib releases the GIL on large updates, so files hash in parallel
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = dict(zip(files, pool.map(lambda rel: _sha256(path / rel), files), strict=True))
    for rel, info in files.items():
        if digests[rel] != info["sha256"]:
            raise HipcError(
                f"{path / rel}: contents differ from the manifest's sha256 (corrupt or "
                "modified since it was compiled); recompile the artifact"
            )
    if stamp is not None:
        _write_stamp(stamp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
    except OSError as e:
        raise HipcError(f"{path}: cannot read ({e.strerror})") from None
    return h.hexdigest()


def stamp_dir() -> Path:
    """Where verification stamps live: the kernel cache's root, like `hipc cache` uses."""
    root = os.environ.get("HIPC_CACHE_DIR")
    if root:
        return Path(root) / "verified"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hipc" / "verified"


def _stamp_path(path: Path, manifest_bytes: bytes, stats: dict[str, tuple]) -> Path | None:
    h = hashlib.sha256(b"hipc-verified-v1\0")
    h.update(str(path.resolve()).encode("utf-8", "surrogateescape") + b"\0")
    h.update(hashlib.sha256(manifest_bytes).digest())
    for rel in sorted(stats):
        h.update(f"{rel}\0{stats[rel]}\0".encode("utf-8", "surrogateescape"))
    try:
        return stamp_dir() / h.hexdigest()
    except RuntimeError:  # no home directory to put it in
        return None


def _write_stamp(stamp: Path, path: Path) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"artifact": str(path)}) + "\n")
        os.replace(tmp, stamp)
    except OSError:
        pass  # a read-only or full cache: hash again next time, nothing worse


# ------------------------------------------------------------------ the plan


def _int(where: str, value: Any, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise HipcError(f"{where}: expected an integer >= {lo}, got {value!r}")
    return value


def _shape(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise HipcError(f"{where}: expected a list of sizes, got {value!r}")
    return tuple(value)


def check_plan(
    plan: Any, weights: Mapping[str, Any] | None, where: Path, targets: Iterable[str] = ("cpu",)
) -> None:
    """plan.json (at `where`) agrees with itself and with the weights file's tensors.

    `weights` maps tensor names to entries with `.dtype` and `.shape` (a SafetensorsFile's
    entries), or is None when the artifact has no weights file. The cpu program's sections
    (memory, kernels, launches) must be there when `targets` has "cpu", and a GPU section
    per GPU target.
    """
    if not isinstance(plan, dict):
        raise HipcError(f"{where}: not a JSON object")
    max_context = _int(f"{where}: max_context", plan.get("max_context"))
    max_tokens = _int(f"{where}: max_tokens", plan.get("max_tokens"))
    vocab = _int(f"{where}: vocab_size", plan.get("vocab_size"))
    # a step may hold more rows than one context (several sequences' prompts at once), up
    # to the compiler's --prefill-chunk bound
    if not 1 <= max_tokens <= MAX_STEP_TOKENS or max_context < 2:
        raise HipcError(
            f"{where}: max_tokens {max_tokens} / max_context {max_context} out of range "
            f"(1..{MAX_STEP_TOKENS} tokens a step, a context of 2 or more)"
        )

    specs = plan.get("weights")
    if not isinstance(specs, list):
        raise HipcError(f"{where}: 'weights' is not a list")
    shapes: dict[str, tuple[int, ...]] = {}
    for i, w in enumerate(specs):
        at = f"{where}: weights[{i}]"
        if not isinstance(w, dict) or not isinstance(w.get("name"), str):
            raise HipcError(f"{at}: expected an object with a 'name'")
        name = w["name"]
        stored = _shape(f"{at} ({name}) stored_shape", w.get("stored_shape", w.get("shape")))
        shapes[name] = _shape(f"{at} ({name}) shape", w.get("shape", stored))
        if weights is not None:
            entry = weights.get(name)
            if entry is None:
                raise HipcError(f"{where}: weight {name!r} is not in weights.safetensors")
            dtype = w.get("dtype", entry.dtype)
            # block-quantized types (q4_1, q8_0 ...) are stored as their packed bytes; the
            # compiler writes bfloat16 weights as their uint16 bit patterns
            stored_as = dtype if dtype in PLAIN_DTYPES else "uint8"
            allowed = {stored_as, "uint16"} if dtype == "bfloat16" else {stored_as}
            if tuple(entry.shape) != stored or entry.dtype not in allowed:
                raise HipcError(
                    f"{where}: weight {name!r} is {w.get('dtype')} {list(stored)}, "
                    f"weights.safetensors holds {entry.dtype} {list(entry.shape)}"
                )

    states = plan.get("states")
    if not isinstance(states, list):
        raise HipcError(f"{where}: 'states' is not a list")
    state_shapes: dict[str, tuple[int, ...]] = {}
    for i, s in enumerate(states):
        at = f"{where}: states[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("name"), str):
            raise HipcError(f"{at}: expected an object with a 'name'")
        shape = _shape(f"{at} ({s['name']}) shape", s.get("shape"))
        if s.get("dtype", "float32") not in STATE_DTYPES:
            raise HipcError(
                f"{at} ({s['name']}): dtype {s.get('dtype')!r} is not one of {STATE_DTYPES}"
            )
        # a KV cache holds max_context positions; a recurrent state's size is its own
        if s.get("kind", "kv") == "kv" and (not shape or shape[0] != max_context):
            raise HipcError(
                f"{at} ({s['name']}): shape {list(shape)} does not hold max_context "
                f"{max_context} positions"
            )
        state_shapes[s["name"]] = shape

    targets = set(targets)
    sections = plan.get("targets") or {}
    for target in sorted(targets):
        if not isinstance(sections, dict) or not isinstance(sections.get(target), dict):
            raise HipcError(
                f"{where}: no targets.{target} launch plan for the {target} code object"
            )
    _check_steps(plan, where, len(specs), len(states))
    if "cpu" not in targets and "memory" not in plan:
        return
    memory = plan.get("memory")
    if not isinstance(memory, dict):
        raise HipcError(f"{where}: 'memory' is not an object")
    if "max_tokens" in memory and memory["max_tokens"] != max_tokens:
        raise HipcError(
            f"{where}: memory.max_tokens {memory['max_tokens']!r} differs from max_tokens {max_tokens}"
        )
    per_token = memory.get("arena_floats_per_token")
    if per_token is not None:
        per_token = _int(f"{where}: memory.arena_floats_per_token", per_token, 0)
        if "arena_bytes" in memory and memory["arena_bytes"] != 4 * per_token * max_tokens:
            raise HipcError(
                f"{where}: memory.arena_bytes {memory['arena_bytes']!r} is not "
                f"4 x {per_token} x max_tokens {max_tokens}"
            )
    logits = (memory.get("outputs") or {}).get("logits")
    if logits is not None and logits != vocab:
        raise HipcError(
            f"{where}: memory.outputs.logits {logits!r} differs from vocab_size {vocab}"
        )

    _check_launches(plan, where, shapes, state_shapes, vocab, max_context)


def _check_launches(
    plan: dict, where: Path, weights: dict, states: dict, vocab: int, max_context: int
) -> None:
    kernels = plan.get("kernels")
    launches = plan.get("groups")
    if not isinstance(kernels, dict) or not isinstance(launches, list):
        raise HipcError(f"{where}: 'kernels' must be an object and 'groups' a list")
    buffers = plan["memory"].get("buffers") or {}
    views = plan["memory"].get("views") or {}
    for i, launch in enumerate(launches):
        at = f"{where}: groups[{i}]"
        if not isinstance(launch, dict):
            raise HipcError(f"{at}: expected an object")
        kernel = kernels.get(launch.get("kernel"))
        if not isinstance(kernel, dict):
            raise HipcError(f"{at}: kernel {launch.get('kernel')!r} is not in plan.kernels")
        args = launch.get("args")
        if not isinstance(args, dict):
            raise HipcError(f"{at}: 'args' is not an object")
        for name, arg in args.items():
            if not isinstance(arg, dict):
                raise HipcError(f"{at}: argument {name!r} is not an object")
            kind, ref = arg.get("kind"), arg.get("ref")
            known = {"weight": weights, "state": states, "act": {**buffers, **views}}.get(kind)
            if known is not None and ref not in known:
                raise HipcError(
                    f"{at}: argument {name!r} names {kind} {ref!r}, which the plan lacks"
                )
        params = kernel.get("params") or {}
        template = kernel.get("kind")
        if template == "embedding":
            table = weights.get((args.get("w") or {}).get("ref"))
            if table is not None and table[0] != vocab:
                raise HipcError(
                    f"{at}: the embedding table has {table[0]} rows, vocab_size is {vocab}"
                )
        if template == "attention":
            want = (params.get("NKV"), params.get("D"))
            for cache in ("k_cache", "v_cache"):
                ref = (args.get(cache) or {}).get("ref")
                shape = states.get(ref)
                if shape is not None and tuple(shape[1:3]) != want:
                    raise HipcError(
                        f"{at}: state {ref!r} has shape {list(shape)}, the attention kernel "
                        f"needs [{max_context}, {want[0]}, {want[1]}]"
                    )
            for table in ("cos", "sin"):
                ref = (args.get(table) or {}).get("ref")
                shape = weights.get(ref)
                if shape is not None and shape[0] < max_context:
                    raise HipcError(
                        f"{at}: rope table {ref!r} has {shape[0]} rows, fewer than max_context "
                        f"{max_context}"
                    )


def _check_steps(plan: dict, where: Path, n_weights: int, n_states: int) -> None:
    sections = plan.get("targets") or {}
    if not isinstance(sections, dict):
        raise HipcError(f"{where}: 'targets' is not an object")
    for target, tplan in sections.items():
        steps = tplan.get("steps") if isinstance(tplan, dict) else None
        if not isinstance(steps, dict):
            raise HipcError(f"{where}: targets.{target} has no 'steps' object")
        for step, launches in steps.items():
            for i, launch in enumerate(launches or []):
                at = f"{where}: targets.{target}.steps.{step}[{i}]"
                if not isinstance(launch, dict) or not isinstance(launch.get("kernel"), str):
                    raise HipcError(f"{at}: expected an object naming its 'kernel'")
                for j, arg in enumerate(launch.get("args") or []):
                    if not isinstance(arg, dict):
                        raise HipcError(f"{at}: args[{j}] is not an object")
                    limit = {"weight": n_weights, "state": n_states}.get(arg.get("kind"))
                    index = arg.get("index")
                    if limit is not None and not (
                        isinstance(index, int)
                        and not isinstance(index, bool)
                        and 0 <= index < limit
                    ):
                        raise HipcError(
                            f"{at}: args[{j}] names {arg.get('kind')} {index!r}; the plan has {limit}"
                        )
