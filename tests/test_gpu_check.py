"""``scripts/gpu_check.sh`` on a host like the GPU host: without ``gguf`` and ``openai`` (no package index
there). The script must still collect its CUDA tests, which ``pytest -m cuda tests`` could not: it imports
every test module first, and the ones importing those packages end the run with collection errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BLOCKER = """
import importlib.abc
import sys

class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("gguf", "openai"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: as on the GPU host)")
        return None

sys.meta_path.insert(0, _Absent())
"""


def _env_without_gguf_and_openai(tmp_path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHON=sys.executable)
    env.pop("RAWPAGED_REQUIRE_CUDA", None)
    return env


def test_the_script_names_every_module_with_cuda_tests():
    listed = re.search(r"CUDA_TEST_FILES=\(([^)]*)\)", SCRIPT.read_text()).group(1).split()
    marked = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.cuda\b|mark\.cuda\b", p.read_text())
    )
    assert sorted(listed) == marked


def test_the_script_collects_its_cuda_tests_without_gguf_and_openai(tmp_path):
    env = _env_without_gguf_and_openai(tmp_path)
    blocked = subprocess.run([sys.executable, "-c", "import gguf"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "blocked" in blocked.stderr  # the host's situation is reproduced
    r = subprocess.run(
        ["bash", str(SCRIPT), "--collect-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    collected = int(re.search(r"(\d+) tests? collected", r.stdout).group(1))
    assert collected >= 50 and "error" not in r.stdout.lower()
    # the engine, the server and the script's engine check import without them too
    modules = "rawpaged.check_cuda_engine, rawpaged.engine.llm_engine, rawpaged.entrypoints.app, rawpaged.kernels.cuda"
    r = subprocess.run([sys.executable, "-c", f"import {modules}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    # what the script ran before: every test module imported, and the run ended at collection
    old = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert old.returncode == 2 and "gguf" in old.stdout
