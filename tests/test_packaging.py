"""Every package folder is in pyproject.toml: an editable install finds a folder missing from
the list, a wheel (what a serving box installs) leaves it out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_every_package_folder_is_listed():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in config["package-dir"].items()}
    assert set(folders.values()) == set(config["packages"])
    top = set(folders) & {p.name for p in ROOT.iterdir()}
    found = {
        str(init.parent.relative_to(ROOT))
        for folder in top
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found, "no package folders found"
    assert sorted(found - set(folders)) == []
