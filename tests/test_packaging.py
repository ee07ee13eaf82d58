"""pyproject.toml lists packages explicitly (the kernels' sources are mapped from cuda/ into the wheel as
rawpaged._cuda): every package directory and every compiled source must be covered, or a wheel install
would miss it while an editable install still works."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from rawpaged.kernels.cuda import program

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]


def test_wheel_config_covers_every_package_and_cuda_source():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(cfg["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rawpaged").rglob("__init__.py")}
    assert on_disk <= packages, f"packages missing from pyproject.toml: {sorted(on_disk - packages)}"
    assert cfg["package-dir"]["rawpaged._cuda"] == "cuda" and "rawpaged._cuda" in packages
    patterns = cfg["package-data"]["rawpaged._cuda"]
    for name in (program.HEADER, *program.SOURCE_FILES):
        assert (ROOT / "cuda" / name).is_file()
        assert any(fnmatch.fnmatch(name, pat) for pat in patterns), f"{name} not shipped in wheels"


def test_wheel_config_ships_the_playground_page():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = cfg["package-data"]["rawpaged.entrypoints"]
    static = sorted((ROOT / "rawpaged" / "entrypoints" / "static").iterdir())
    assert {p.name for p in static} >= {"index.html", "playground.js", "playground.css"}
    for path in static:
        rel = path.relative_to(ROOT / "rawpaged" / "entrypoints").as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), f"{rel} not shipped in wheels"
