"""The GPU host's Python, reproduced on this machine: every installed distribution that the host's package
list (``tests/gpu_host_packages.txt``) does not name is made unimportable in child processes.

A ``sitecustomize.py`` written by :func:`host_env` sets ``sys.modules[name] = None`` for each top-level
module of those distributions, so ``import name`` raises ``ImportError`` and ``importlib.util.find_spec``
returns None, as where the package is absent (a finder that raised instead would break libraries that
probe for optional packages, such as yarl for ``pydantic_core``). It also hides those distributions from
``importlib.metadata`` (their entry points too: hypothesis loads every installed ``hypothesis`` plugin,
and trio's would fail). Modules and distributions found in ``allow_dirs`` (the wheels the device check
carries, installed into a target folder) are left visible.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_LIST = Path(__file__).with_name("gpu_host_packages.txt")
PROJECT = "rawpaged"  # runs from the source tree there (PYTHONPATH=.)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def host_packages() -> set[str]:
    """The normalized distribution names on the GPU host."""
    lines = PACKAGE_LIST.read_text().splitlines()
    return {_normalize(s) for s in lines if s.strip() and not s.startswith("#")}


def _on_host(name: str, host: set[str]) -> bool:
    n = _normalize(name)
    return n == PROJECT or n in host or re.sub(r"-cu1[23]$", "", n) in host


def _top_level(dist) -> set[str]:
    """Top-level importable names a distribution installs (its ``top_level.txt``, else its file list)."""
    text = dist.read_text("top_level.txt")
    if text:
        return {s.strip().replace("/", ".").split(".")[0] for s in text.split() if s.strip()}
    names = set()
    for f in dist.files or ():
        parts = Path(str(f)).parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".data", ".egg-info")):
            continue
        if len(parts) > 1:
            names.add(parts[0])
        elif parts[0].endswith(".py"):
            names.add(parts[0][:-3])
        elif parts[0].endswith((".so", ".pyd")):
            names.add(parts[0].split(".")[0])
    return {n for n in names if n.isidentifier()}


def blocked_distributions() -> list[str]:
    """Normalized names of the installed distributions the GPU host lacks."""
    host = host_packages()
    return sorted(
        {_normalize(d.metadata["Name"] or "") for d in md.distributions()}
        - {""}
        - {_normalize(d.metadata["Name"]) for d in md.distributions() if _on_host(d.metadata["Name"] or "", host)}
    )


def blocked_modules(allow_dirs=()) -> list[str]:
    """Top-level module names of the installed distributions the host lacks, except names that a
    distribution on the host also provides (namespace packages such as ``nvidia``) and names found in
    ``allow_dirs``."""
    host = host_packages()
    absent, present = set(), set()
    for dist in md.distributions():
        name = dist.metadata["Name"] or ""
        (present if _on_host(name, host) else absent).update(_top_level(dist))
    allowed = set()
    for d in allow_dirs:
        for p in Path(d).iterdir():
            allowed.add(p.name.split(".")[0])
    return sorted(absent - present - allowed - set(sys.stdlib_module_names))


def host_env(tmp_path, allow_dirs=(), **extra) -> dict:
    """Environment for a child process that sees only the GPU host's packages (plus ``allow_dirs``,
    put first on ``PYTHONPATH``). Also sets ``PYTHON`` for ``scripts/gpu_check.sh``."""
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    source = _SITECUSTOMIZE.format(
        modules=blocked_modules(allow_dirs),
        dists=blocked_distributions(),
        allow=[str(Path(d).resolve()) for d in allow_dirs],
    )
    (Path(tmp_path) / "sitecustomize.py").write_text(source)
    path = [*(str(d) for d in allow_dirs), str(tmp_path), str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHON=sys.executable, **extra)
    env.pop("RAWPAGED_REQUIRE_CUDA", None)
    return env


_SITECUSTOMIZE = """# written by tests/gpu_host.py: the packages the GPU host lacks, made absent
import importlib.metadata as _md
import re as _re
import sys as _sys

for _name in {modules!r}:
    _sys.modules.setdefault(_name, None)

_BLOCKED = frozenset({dists!r})
_ALLOW = tuple({allow!r})


def _hidden(dist):
    name = _re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
    where = str(getattr(dist, "_path", ""))
    return name in _BLOCKED and not where.startswith(_ALLOW)


_distributions = _md.distributions
_from_name = _md.Distribution.from_name.__func__


def distributions(**kwargs):
    return (d for d in _distributions(**kwargs) if not _hidden(d))


def _from_name_visible(cls, name):
    for d in distributions(name=name):
        return d
    dist = _from_name(cls, name)
    if _hidden(dist):
        raise _md.PackageNotFoundError(name)
    return dist


_md.distributions = distributions
_md.Distribution.from_name = classmethod(_from_name_visible)
"""
