"""What a first user meets: the served model's names (the default model's GGUF keeps the default model's
name; ``--served-model-name`` takes several), the start-up phases in the log and in ``/health``, and
README's measured test time."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

from rawpaged.config import EngineConfig
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.entrypoints import cli as cli_mod
from rawpaged.entrypoints.api_server import create_app, model_name_of
from rawpaged.entrypoints.generation.admission import check_model
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.state import STATE
from rawpaged.weights import DEFAULT_MODEL
from rawpaged.weights.default_model import F32_GGUF_NAME, GGUF_NAME
from tests.entrypoints.server_thread import ServerThread, get_json, run

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("file_name", [GGUF_NAME, F32_GGUF_NAME])
def test_the_default_models_gguf_is_served_under_the_default_models_name(tmp_path, file_name):
    config = EngineConfig(model=str(tmp_path / "SmolLM2-135M-Instruct" / file_name))
    assert model_name_of(config) == DEFAULT_MODEL
    state = create_app(config)[STATE]
    assert state.model_name == DEFAULT_MODEL
    check_model(state, DEFAULT_MODEL)  # the docs' examples' name: no 404
    check_model(state, config.model)
    assert model_name_of(EngineConfig(model=str(tmp_path / "other.Q4_K_M.gguf"))) == "other.Q4_K_M"


def test_several_served_model_names_the_first_reported_each_accepted(tmp_path):
    args = cli_mod.build_serve_parser().parse_args(["--served-model-name", "smol", "gpt-4o-mini"])
    assert args.served_model_name == ["smol", "gpt-4o-mini"]
    state = create_app(EngineConfig(model=str(tmp_path / "m")), served_model_name=args.served_model_name)[STATE]
    assert state.model_name == "smol"
    for name in ("smol", "gpt-4o-mini", "m"):
        check_model(state, name)
    with pytest.raises(ProtocolError, match="serves `smol`"):
        check_model(state, "gpt-17")
    assert create_app(EngineConfig(model=str(tmp_path / "m")), served_model_name="one")[STATE].model_name == "one"


# ------------------------------------------------------------------------------------------ phases
def test_health_and_the_log_say_each_start_up_phase(tiny_dir, monkeypatch, caplog):
    in_warmup, release = threading.Event(), threading.Event()
    warmup = LLMEngine.warmup

    def slow_warmup(self):
        in_warmup.set()
        assert release.wait(60)
        return warmup(self)

    monkeypatch.setattr(LLMEngine, "warmup", slow_warmup)
    caplog.set_level(logging.INFO, logger="rawpaged.server")
    caplog.set_level(logging.INFO, logger="rawpaged.startup")
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    srv = ServerThread(create_app(config)).start()
    try:
        assert in_warmup.wait(120)
        status, body = run(get_json(srv.url + "/health"))
        assert (status, body["status"], body["phase"]) == (503, "loading", "warm-up")
        release.set()
        srv.wait_healthy()
        status, body = run(get_json(srv.url + "/health"))
        assert (status, body["status"], "phase" in body) == (200, "ok", False)
    finally:
        release.set()
        assert srv.stop() == 0
    lines = [r.getMessage() for r in caplog.records if r.name in ("rawpaged.server", "rawpaged.startup")]
    for phase in ("weights", "load", "warm-up"):
        assert any(line.startswith(f"start-up: {phase} (") for line in lines), (phase, lines)
        assert any(re.fullmatch(rf"start-up: {phase} took \d+\.\ds", line) for line in lines), (phase, lines)
    ready = next(i for i, line in enumerate(lines) if line.startswith("ready:"))
    assert ready > max(i for i, line in enumerate(lines) if line.startswith("start-up: warm-up took"))


# ------------------------------------------------------------------------------------------ README
def test_readme_states_the_measured_core_test_time_and_host():
    tests = (ROOT / "README.md").read_text().split("## Tests", 1)[1]
    assert "take\nseconds" not in tests and "take seconds" not in tests
    assert re.search(r"`tests/core`:\s+\d+ s on\s+a [^)]*(core|CPU)", tests), tests[:400]
