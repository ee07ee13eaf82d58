"""``rawpaged run-batch`` on a small random model: good lines give what the engine gives the same request
alone, every bad line gets its own error line (with its ``custom_id``) while the rest run, a route's
refusal keeps its status and error body, ``--resume`` skips what the output holds, and every block is
returned."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json

import benchmarks.run_batch
from rawpaged import SamplingParams
from rawpaged.config import EngineConfig
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.entrypoints.api_server import create_app
from rawpaged.entrypoints.cli import run_batch_main
from rawpaged.entrypoints.openai.batch.run_batch import finished_ids, run_batch

PROMPTS = ["The cat", "Once upon", "A B C", "hello there"]


@pytest.fixture(scope="module")
def tiny_config(tiny_dir):
    return EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def engine(tiny_config):
    return LLMEngine(tiny_config)


def greedy_alone(engine, prompt, max_tokens):
    """The engine's greedy text for ``prompt`` run by itself, offline."""
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id=f"ref-{prompt}")
    text = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    return text


def line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def completion(prompt, max_tokens=6, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def run(engine, config, path_in, path_out, **kw):
    app = create_app(config, engine=engine, served_model_name="tiny")
    return asyncio.run(run_batch(app, path_in, path_out, progress=False, **kw))


def read_lines(path):
    return {d["custom_id"]: d for d in map(json.loads, path.read_text().splitlines())}


def test_good_lines_match_the_engine_and_bad_lines_get_their_own_errors(tmp_path, engine, tiny_config):
    good = [line(f"ok-{i}", "/v1/completions", completion(p)) for i, p in enumerate(PROMPTS)]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    lines = [
        *good[:2],
        "{not json",
        line("bad-url", "/v1/images/generations", {}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": completion("x")}),
        line("bad-method", "/v1/completions", completion("x"), method="GET"),
        line("streams", "/v1/completions", completion("x", stream=True)),
        line("ok-0", "/v1/completions", completion("again")),  # a duplicate custom_id
        line("refused", "/v1/completions", completion("x", max_tokens=-1)),
        line("other-model", "/v1/completions", {**completion("x"), "model": "nope"}),
        line("chat", "/v1/chat/completions", chat),
        "",
        *good[2:],
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = run(engine, tiny_config, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    rows = (tmp_path / "out.jsonl").read_text().splitlines()
    assert summary.written == len(rows) == 13 and summary.succeeded == 5
    by_id = read_lines(tmp_path / "out.jsonl")
    for i, prompt in enumerate(PROMPTS):
        r = by_id[f"ok-{i}"]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        assert r["response"]["body"]["choices"][0]["text"] == greedy_alone(engine, prompt, 6)
        assert r["response"]["body"]["model"] == "tiny"
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    errors = [json.loads(r) for r in rows if json.loads(r)["error"] is not None]
    no_id = [e for e in errors if e["custom_id"] is None]
    assert {e["error"]["code"] for e in no_id} == {"invalid_json", "invalid_request"}  # unparseable, no custom_id
    assert by_id["bad-url"]["response"] is None and by_id["bad-url"]["error"]["param"] == "url"
    assert by_id["bad-method"]["error"]["param"] == "method"
    assert by_id["streams"]["error"]["param"] == "body.stream"
    dup = [e for e in errors if e["error"]["code"] == "duplicate_custom_id"]
    assert len(dup) == 1 and dup[0]["custom_id"] == "ok-0"
    refused = by_id["refused"]
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] is None
    assert refused["response"]["request_id"].startswith("batch-")  # the route answered without an id
    assert refused["error"]["param"] == "max_tokens"
    assert by_id["other-model"]["response"]["status_code"] == 404
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_resume_skips_the_finished_lines_and_keeps_them(tmp_path, engine, tiny_config):
    lines = [line(f"r-{i}", "/v1/completions", completion(p, max_tokens=3)) for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    first = json.dumps({"id": "batch_req_x", "custom_id": "r-1", "response": None, "error": None})
    out.write_text(first + '\n{"id": "batch_req_y", "custom_id": "r-')  # cut off mid-line by an interruption
    assert finished_ids(out) == {"r-1"}
    out.write_text(first + "\n")
    summary = run(engine, tiny_config, tmp_path / "in.jsonl", out, resume=True)
    assert (summary.skipped, summary.written) == (1, 3)
    ids = [json.loads(r)["custom_id"] for r in out.read_text().splitlines()]
    assert ids[0] == "r-1" and sorted(ids) == ["r-0", "r-1", "r-2", "r-3"]


def test_the_command_runs_a_file(tmp_path, tiny_dir, capsys):
    (tmp_path / "in.jsonl").write_text(line("one", "/v1/completions", completion("abc", max_tokens=2)) + "\n")
    argv = ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_dir)]
    argv += ["--num-kv-blocks", "32", "--max-model-len", "128", "--served-model-name", "tiny"]
    assert run_batch_main(argv) == 0
    assert read_lines(tmp_path / "out.jsonl")["one"]["response"]["status_code"] == 200
    err = capsys.readouterr().err
    summary = benchmarks.run_batch.SUMMARY.search(err)  # what the benchmark reads
    assert "1 lines written" in err and summary is not None and summary.groups()[:3] == ("1", "0", "2")
    assert run_batch_main(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 1
