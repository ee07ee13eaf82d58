"""README's "Layout" and docs/architecture.md name real paths: a renamed or moved module fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH_TOKEN = re.compile(r"`([\w./-]+(?:\.py|\.cu|\.js|\.html|/))`")


def exists(name: str, where: Path = ROOT) -> bool:
    """``name`` under ``where``, under ``rawpaged/``, or (a bare file name) anywhere in the package."""
    if (where / name).exists() or (ROOT / name).exists() or (ROOT / "rawpaged" / name).exists():
        return True
    return "/" not in name.rstrip("/") and any((ROOT / "rawpaged").rglob(name.rstrip("/")))


def layout_entries(readme: str) -> list:
    """(parent directory, entry) for each entry of README's Layout block: a first-column name, or
    ``a/, b/`` names, indented two spaces under the top-level directory they belong to."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    entries, parent = [], ROOT
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+(?:, \S+)*)(?:  |$)", line)
        if not m or not line.strip():
            continue
        names = [n for n in m.group(2).split(", ")]
        if not m.group(1):
            parent = ROOT / names[0] if names[0].endswith("/") else ROOT
            entries.extend((ROOT, n) for n in names)
        elif len(m.group(1)) == 2:
            entries.extend((parent, n) for n in names)
    return entries


def test_readme_layout_names_paths_that_exist():
    entries = layout_entries((ROOT / "README.md").read_text())
    assert len(entries) > 15
    missing = [str(p / n) for p, n in entries if not (p / n).exists()]
    assert not missing, missing


def test_architecture_page_names_paths_that_exist():
    names = set(PATH_TOKEN.findall((ROOT / "docs" / "architecture.md").read_text()))
    assert len(names) > 30
    missing = sorted(n for n in names if not exists(n))
    assert not missing, missing


def test_the_checks_fail_on_a_path_that_does_not_exist():
    readme = "## Layout\n\n```\nrawpaged/   x\n  nowhere/  y\n```\n"
    assert [str(p / n) for p, n in layout_entries(readme) if not (p / n).exists()] == [
        str(ROOT / "rawpaged" / "nowhere/")
    ]
    assert not exists("kernels/nowhere.py")


def test_readme_is_the_front_door_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to a page under docs/"
