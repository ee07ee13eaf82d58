"""The device check as the GPU host runs it, on this machine: every package the host lacks is made absent
(``tests/gpu_host.py``, from the host's package list in ``tests/gpu_host_packages.txt``), then what
``scripts/gpu_check.sh`` runs must import, collect and run: rawpaged, the CUDA tests, the engine check's CPU
side of every shape, an offline generate, and the server with only the wheels of ``scripts/gpu_wheels.sh``
added to its path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_host import host_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(args, env, timeout=600, **kw):
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def _python(code: str, env, timeout=300):
    return _run([sys.executable, "-c", code], env, timeout)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return host_env(tmp_path_factory.mktemp("gpu-host"))


def test_the_gpu_hosts_python_is_reproduced(host):
    r = _python(
        "import importlib.metadata as md, importlib.util as u\n"
        "import aiohttp, numba, ml_dtypes, tokenizers, safetensors, jinja2\n"  # on the host
        "for name in ('pydantic', 'pydantic_core', 'llguidance', 'gguf', 'openai', 'ray', 'jsonschema', 'selenium'):\n"
        "    assert u.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "        raise SystemExit(f'{name} imported')\n"
        "    except ImportError:\n"
        "        pass\n"
        "try:\n"
        "    md.version('pydantic')\n"
        "    raise SystemExit('pydantic metadata visible')\n"
        "except md.PackageNotFoundError:\n"
        "    pass\n"
        "assert not list(md.entry_points(group='hypothesis'))\n",
        host,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_rawpaged_the_checks_and_the_benchmark_import_there(host):
    modules = (
        "rawpaged, rawpaged.engine.llm_engine, rawpaged.kernels.cuda.backend, rawpaged.tools.check_cuda_engine, "
        "rawpaged.entrypoints.llm, rawpaged.entrypoints.cli, benchmarks.kernels_cuda"
    )
    r = _python(f"import {modules}", host)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run([sys.executable, "scripts/server_smoke.py", "--help"], host)
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_cuda_test_is_collected_there(host):
    args = [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"]
    blocked = _run(args, host)
    assert blocked.returncode == 0, blocked.stdout[-3000:] + blocked.stderr[-2000:]
    assert "error" not in blocked.stdout.lower()
    here = _run(args, dict(host_env_unblocked()))
    assert here.returncode == 0

    def ids(out):
        return {line for line in out.splitlines() if "::" in line}

    assert len(ids(blocked.stdout)) >= 100 and ids(blocked.stdout) == ids(here.stdout)
    r = _run(["bash", str(SCRIPT), "--collect-only"], host)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert ids(r.stdout) == ids(here.stdout)


def host_env_unblocked() -> dict:
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAWPAGED_REQUIRE_CUDA", None)
    return env


@pytest.mark.slow
def test_the_engine_checks_cpu_side_runs_every_shape_there(host, tmp_path):
    from rawpaged.tools.check_cuda_engine import ALL_SHAPES

    r = _run([sys.executable, "-m", "rawpaged.tools.check_cuda_engine", "--cpu-only", "--out", str(tmp_path)], host)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ALL_SHAPES:
        result = json.loads((tmp_path / f"engine_{name}.json").read_text())
        assert result["ok"] and result["cpu_only"] and result["num_prompts"] == 8, (name, result)
    assert set(json.loads((tmp_path / "engine_check.json").read_text())) == set(ALL_SHAPES)


def test_offline_generate_runs_there_and_a_grammar_names_its_package(host, tmp_path):
    code = f"""
from rawpaged import LLM, SamplingParams
from rawpaged.errors import MissingDependencyError
from rawpaged.testing.random_model import write_random_model
from rawpaged.structured_output.params import StructuredOutputsParams

llm = LLM(model=str(write_random_model({str(tmp_path / "m")!r}, seed=0)), device="cpu", num_kv_blocks=32)
out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 4
try:
    llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
    raise SystemExit("a grammar compiled without llguidance")
except MissingDependencyError as e:
    assert "'llguidance'" in str(e) and "pip install llguidance" in str(e) and e.param == "structured_outputs", e
stats = llm.stats()
assert stats["num_free_blocks"] == stats["num_total_blocks"]
try:
    LLM(model={str(tmp_path / "x.gguf")!r}, device="cpu")
except ValueError as e:
    print("gguf:", e)
"""
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(60))
    r = _python(code, host)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "needs the package 'gguf'" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    """scripts/gpu_wheels.sh's wheels for this Python, installed into a target folder as gpu_check.sh does."""
    d = tmp_path_factory.mktemp("wheels")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = _run(["bash", "scripts/gpu_wheels.sh", "--dest", str(d / "whl"), "--python-version", version], None, 300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert re.search(r"total: 6 wheels, \d+ bytes", r.stdout)
    site = d / "site"
    wheels = sorted(str(p) for p in (d / "whl").glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    r = _run([*cmd, str(site), *wheels], None, 300)
    assert r.returncode == 0, r.stderr[-3000:]
    return site


@pytest.mark.slow
def test_the_server_runs_there_with_only_the_carried_wheels(tmp_path, wheel_site):
    without = _run([sys.executable, "server.py", "--model", str(tmp_path)], host_env(tmp_path / "a"), 120)
    assert without.returncode == 1 and "needs the package 'pydantic'" in without.stderr, without.stderr[-2000:]
    (tmp_path / "b").mkdir()
    env = host_env(tmp_path / "b", allow_dirs=[wheel_site])
    r = _python("import pydantic, pydantic_core, llguidance; print(pydantic.__file__)", env)
    assert r.returncode == 0 and str(wheel_site) in r.stdout, r.stderr[-2000:]
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/server_smoke.py", "--device", "cpu", "--shape", "tiny", "--out", str(out)]
    r = _run(cmd, env, 600)
    result = json.loads((out / "server_smoke.json").read_text())
    assert r.returncode == 0 and result["ok"], json.dumps(result, indent=1)[-4000:]
    assert set(result["checks"]) == {
        "streamed_chat",
        "websocket_generate",
        "parallel_sampling",
        "structured_chat",
        "concurrent_completions",
        "blocks_back",
    }
    assert result["checks"]["blocks_back"]["num_free_blocks"] == result["checks"]["blocks_back"]["num_total_blocks"]


def test_the_script_reports_each_stage_as_it_ends(host, tmp_path):
    """Without a GPU: the stages that need one FAIL, each leaves its JSON and log, the summary has a line per
    stage, the archive holds them, and stages the budget cannot fit are SKIPped."""
    out, archive = tmp_path / "out", tmp_path / "check.tgz"
    args = ["bash", str(SCRIPT), "--out", str(out), "--archive", str(archive), "--stages", "env,imports,bench"]
    r = _run(args, host, 300)
    assert r.returncode == 1, r.stdout[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("device:") and summary[2:] == ["PASS env", "FAIL imports", "FAIL bench"]
    stage = json.loads((out / "stage_imports.json").read_text())
    assert stage["status"] == "FAIL" and any("cupy" in line for line in stage["tail"])
    listed = subprocess.run(["tar", "tzf", str(archive)], capture_output=True, text=True).stdout
    assert "./stage_bench.json" in listed and "./summary.txt" in listed
    r = _run(["bash", str(SCRIPT), "--out", str(out), "--budget", "5", "--stages", "pytest,server"], host, 120)
    assert (out / "summary.txt").read_text().splitlines()[2:] == ["SKIP pytest", "SKIP server"]
    assert r.returncode == 1
