"""Load and validate a NAME.hipc/ artifact (no compiler, toolchain or Jinja needed).

Checked on load: the format and its version, that every file the manifest lists is
there with its size, and the code objects' checksums. A problem is one HipcError
naming the file, never a crash deep inside a kernel.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hipc.base.errors import HipcError
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
        return Tokenizer.from_dict(meta, self.file("tokenizer.json").read_text(encoding="utf-8"))

    def generation_defaults(self) -> dict[str, Any]:
        return _read_json(self.file("generation.json"))

    @property
    def kv_storage(self) -> str:
        return plan_kv_storage(self.plan)


def plan_kv_storage(plan: dict[str, Any]) -> str:
    """The KV cache's element type (`hipc compile --kv-storage`), from the plan's states."""
    states = plan.get("states") or [{}]
    return states[0].get("dtype", "float32")


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def load_artifact(path: str | Path) -> Artifact:
    path = Path(path)
    if not path.is_dir():
        raise HipcError(f"{path}: no such artifact directory")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise HipcError(f"{path}: not a hipc artifact (no manifest.json)")
    manifest = _read_json(manifest_path)
    if manifest.get("format") != "hipc-artifact":
        raise HipcError(f"{manifest_path}: not a hipc artifact manifest")
    version = manifest.get("format_version")
    if version != ARTIFACT_FORMAT_VERSION:
        raise HipcError(
            f"{manifest_path}: artifact format version {version}, this hipc reads version "
            f"{ARTIFACT_FORMAT_VERSION}; recompile it with this hipc (hipc compile)"
        )
    for rel, info in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise HipcError(f"{f}: missing from the artifact")
        if f.stat().st_size != info["size"]:
            raise HipcError(
                f"{f}: size {f.stat().st_size} bytes, the manifest says {info['size']} (truncated or replaced)"
            )
    for target in manifest["targets"].values():
        rel = target["code_object"]
        digest = hashlib.sha256((path / rel).read_bytes()).hexdigest()
        if digest != manifest["files"][rel]["sha256"]:
            raise HipcError(f"{path / rel}: checksum mismatch (corrupt code object)")
    return Artifact(path, manifest, _read_json(path / "plan.json"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HipcError(f"{path}: missing from the artifact") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HipcError(f"{path}: malformed JSON ({e})") from None
