"""The launch-plan schema (hipc.base.launch_plan): versions, state kinds, bindings."""

from __future__ import annotations

import hashlib
import json

import pytest

from hipc.base.errors import HipcError
from hipc.base.launch_plan import (
    LAUNCH_PLAN_FORMAT,
    LAUNCH_PLAN_VERSION,
    Bases,
    Launch,
    StateSpec,
    TargetPlan,
    check_launch_plan,
    prefix_reuse,
)


def plan(**over) -> dict:
    p = {
        "format": LAUNCH_PLAN_FORMAT,
        "version": LAUNCH_PLAN_VERSION,
        "max_context": 16,
        "max_tokens": 4,
        "vocab_size": 10,
        "weights": [],
        "states": [{"name": "k", "kind": "kv", "dtype": "bfloat16", "shape": [16, 2, 8]}],
        "targets": {
            "cpu": {
                "entry": "hipc_forward",
                "abi_version": 1,
                "arena_bytes": 64,
                "scratch_bytes": 0,
                "steps": {"forward": [{"kernel": "f", "args": [{"kind": "int", "value": "T"}]}]},
            }
        },
    }
    p.update(over)
    return p


def test_a_plan_of_another_version_is_refused_in_one_line():
    check_launch_plan(plan(), "x/plan.json")
    with pytest.raises(HipcError, match=r"x/plan.json: launch plan version 1, .* reads version"):
        check_launch_plan(plan(version=1), "x/plan.json")
    old = plan()
    del old["format"], old["version"]  # what hipc wrote before the plan was versioned
    with pytest.raises(
        HipcError, match=r"x/plan\.json: not a launch plan this hipc reads .* recompile"
    ):
        check_launch_plan(old, "x/plan.json")
    bad = plan()
    bad["targets"]["cpu"]["steps"]["forward"][0]["args"] = [{"kind": "pointer"}]
    with pytest.raises(HipcError, match="malformed launch plan"):
        check_launch_plan(bad, "x/plan.json")


def test_state_kinds_size_reset_and_reuse():
    kv = StateSpec("k", "kv", "bfloat16", (16, 2, 8))
    rec = StateSpec("s", "recurrent", "float32", (4, 8, 8))
    # a KV cache is sized by the positions a runtime admits; a recurrent state is not
    assert kv.nbytes(10) == 10 * 2 * 8 * 2 and kv.nbytes() == 16 * 2 * 8 * 2
    assert rec.nbytes(10) == rec.nbytes(4096) == 4 * 8 * 8 * 4
    assert not kv.needs_reset and rec.needs_reset
    assert prefix_reuse([kv]) and not prefix_reuse([kv, rec])
    assert StateSpec.from_json(rec.to_json()) == rec
    assert rec.to_json()["reuse"] == "snapshot" and kv.to_json()["reuse"] == "prefix"
    with pytest.raises(ValueError, match="unknown kind"):
        StateSpec.from_json({"name": "x", "kind": "ring", "shape": [1]})


def test_the_cpu_target_has_one_forward_list():
    cpu = TargetPlan.from_json(plan(), "cpu")
    assert cpu.launches(1) == cpu.launches(4) == cpu.steps["forward"]
    assert cpu.entry == "hipc_forward" and cpu.abi_version == 1


def test_bindings_resolve_to_addresses():
    launch = Launch.from_json(
        {
            "kernel": "k",
            "grid": ["cdiv(rows,2)", "3*T"],
            "block": [64],
            "args": [
                {"kind": "arena", "offset": 8, "row_skip": 4},
                {"kind": "weight", "index": 1},
                {"kind": "state", "index": 0},
                {"kind": "input", "name": "seq"},
                {"kind": "int", "value": "rows"},
                {"kind": "null"},
            ],
        }
    )
    bases = Bases(1000, 2000, (10, 20), (30,), 40, 44, 50, 55, 60)
    assert launch.grid_dims(5, 5) == (3, 15, 1)
    assert launch.resolve(bases, 5, 1) == [
        ("u64", 1000 + 8 + 4 * 4 * 4),
        ("u64", 20),
        ("u64", 30),
        ("u64", 50),
        ("i32", 1),
        ("u64", 0),
    ]
    # "start" was the GPU's one-sequence position before plan version 5
    launch = Launch.from_json({"kernel": "k", "args": [{"kind": "input", "name": "start"}]})
    with pytest.raises(ValueError, match="unknown step input 'start'"):
        launch.resolve(bases, 1, 1)


def test_a_compiled_plan_passes_the_check(tmp_path):
    from hipc.compiler.options import CompileOptions
    from hipc.compiler.pipeline import compile_model
    from hipc.runtime.artifact import load_artifact

    from support import write_tiny_hf

    out = tmp_path / "m.hipc"
    compile_model(write_tiny_hf(tmp_path / "m"), out, CompileOptions(max_context=32), verbose=False)
    p = json.loads((out / "plan.json").read_text())
    assert p["format"] == LAUNCH_PLAN_FORMAT and p["version"] == LAUNCH_PLAN_VERSION
    forward = p["targets"]["cpu"]["steps"]["forward"]
    source = (out / "kernels" / "cpu.cpp").read_text()
    body = source[source.index('extern "C" int hipc_forward') :]
    # hipc_forward calls exactly the plan's forward list, in order
    calls = [
        line.strip().split("(")[0]
        for line in body.splitlines()
        if line.strip().endswith(");") and "(" in line and not line.strip().startswith("//")
    ]
    assert calls == [lt["kernel"] for lt in forward]
    # an artifact whose plan is from another version is refused at load, naming plan.json
    p["version"] = 1
    (out / "plan.json").write_text(json.dumps(p))
    manifest = json.loads((out / "manifest.json").read_text())
    data = (out / "plan.json").read_bytes()
    manifest["files"]["plan.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HipcError, match=r"plan\.json: launch plan version 1"):
        load_artifact(out)
