"""Load and validate a NAME.hipc/ artifact (no compiler, toolchain or Jinja needed).

Checked on load: the format and its version, that every file the manifest lists is
there with its size and sha256 (runtime/integrity.py: hashed once, then stamped), and that
plan.json agrees with the weights and kernels it describes. A problem is one HipcError
naming the file, never a crash deep inside a kernel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hipc.base.errors import HipcError
from hipc.base.launch_plan import StateSpec, check_launch_plan, prefix_reuse, states
from hipc.base.version import ARTIFACT_FORMAT_VERSION


@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]
    plan: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def targets(self) -> list[str]:
        return list(self.manifest["targets"])

    def file(self, rel: str) -> Path:
        return self.path / rel

    def tokenizer(self):
        from hipc.base.tokenizer import Tokenizer

        if not self.file("tokenizer.json").is_file():
            raise HipcError(
                f"{self.path}: the artifact has no tokenizer (its model had none); pass token ids"
            )
        meta = _read_json(self.file("tokenizer_meta.json"))
        path = self.file("tokenizer.json")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise HipcError(f"{path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise HipcError(
                f"{path}: not UTF-8 text (byte {e.start}); recompile the artifact"
            ) from None
        return Tokenizer.from_dict(meta, text)

    def generation_defaults(self) -> dict[str, Any]:
        return _read_json(self.file("generation.json"))

    @property
    def kv_storage(self) -> str:
        return plan_kv_storage(self.plan)

    @property
    def states(self) -> tuple[StateSpec, ...]:
        return states(self.plan)

    @property
    def prefix_reuse(self) -> bool:
        """Whether a prompt's states stay valid for a later sequence with the same prefix
        (every state position-indexed; see hipc.base.launch_plan.StateSpec)."""
        return prefix_reuse(self.states)


def plan_kv_storage(plan: dict[str, Any]) -> str:
    """The KV cache's element type (`hipc compile --kv-storage`), from the plan's states."""
    kv = [s for s in plan.get("states") or [] if s.get("kind", "kv") == "kv"] or [{}]
    return kv[0].get("dtype", "float32")


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def load_artifact(path: str | Path) -> Artifact:
    """The artifact at `path`, its files verified against the manifest's sha256s (or a
    stamp from an earlier verification) and its plan checked against its weights."""
    from hipc.runtime.integrity import check_plan, verify_files

    path = Path(path)
    if not path.is_dir():
        raise HipcError(f"{path}: no such artifact directory")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise HipcError(f"{path}: not a hipc artifact (no manifest.json)")
    try:
        manifest_bytes = manifest_path.read_bytes()
    except OSError as e:
        raise HipcError(f"{manifest_path}: cannot read ({e.strerror})") from None
    manifest = _parse_json(manifest_bytes, manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != "hipc-artifact":
        raise HipcError(f"{manifest_path}: not a hipc artifact manifest")
    version = manifest.get("format_version")
    if version != ARTIFACT_FORMAT_VERSION:
        raise HipcError(
            f"{manifest_path}: artifact format version {version}, this hipc reads version "
            f"{ARTIFACT_FORMAT_VERSION}; recompile it with this hipc (hipc compile)"
        )
    files = manifest.get("files")
    targets = manifest.get("targets")
    if not isinstance(targets, dict) or not targets:
        raise HipcError(f"{manifest_path}: 'targets' is missing or empty")
    for name, target in targets.items():
        rel = target.get("code_object") if isinstance(target, dict) else None
        if not isinstance(rel, str) or not isinstance(files, dict) or rel not in files:
            raise HipcError(
                f"{manifest_path}: target {name!r} names code object {rel!r}, which is not "
                "among the artifact's files"
            )
    for required in ("plan.json", "weights.safetensors"):
        if not isinstance(files, dict) or required not in files:
            raise HipcError(f"{manifest_path}: {required} is not among the artifact's files")
    verify_files(path, manifest, manifest_bytes)
    plan = _read_json(path / "plan.json")
    check_launch_plan(plan, str(path / "plan.json"))
    check_plan(plan, _weight_entries(path / "weights.safetensors"), path / "plan.json", targets)
    return Artifact(path, manifest, plan)


def _weight_entries(path: Path) -> dict[str, Any]:
    from hipc.base.safetensors_file import SafetensorsFile

    return SafetensorsFile(path).entries


def _read_json(path: Path) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise HipcError(f"{path}: missing from the artifact") from None
    except OSError as e:
        raise HipcError(f"{path}: cannot read ({e.strerror})") from None
    return _parse_json(data, path)


def _parse_json(data: bytes, path: Path) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HipcError(f"{path}: malformed JSON ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]
