"""``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` on a small random model: the official ``openai`` SDK's
``embeddings.create`` (floats and base64) gives the vectors ``LLM.embed`` gives for every input form; the
scores are the cosine similarities of those vectors; bad input is a 400 in OpenAI's shape naming the field,
and every block is back afterwards."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import base64

import aiohttp
import numpy as np

from rawpaged import LLM
from rawpaged.config import EngineConfig
from tests.entrypoints.server_thread import openai_client, run, served, stats, wait_pool_empty

MAX_MODEL_LEN = 64
TEXTS = ["the cat sat", "a dog ran far away", "the cat sat on the mat"]
#: the server's vectors against the offline engine's: the same float32 computation batched another way
SAME = 2e-6


@pytest.fixture(scope="module")
def server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)

    def embed(prompts):
        return np.stack([o.outputs.embedding for o in llm.embed(prompts)])

    embed.tokenizer = llm.tokenizer
    return embed


async def post(url, body):
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


def test_openai_sdk_floats_and_base64(server, offline):
    pytest.importorskip("openai")
    client = openai_client(server)
    want = offline(TEXTS)
    # without encoding_format the SDK asks for base64 and decodes it itself; "float" sends lists of numbers
    floats = client.embeddings.create(model=server.state.model_name, input=TEXTS)
    got = np.array([d.embedding for d in floats.data], dtype=np.float32)
    listed = client.embeddings.create(model=server.state.model_name, input=TEXTS, encoding_format="float")
    assert np.array_equal(np.array([d.embedding for d in listed.data], dtype=np.float32), got)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list"
    assert np.abs(got - want).max() < SAME
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    ids = [offline.tokenizer.encode(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    b64 = client.embeddings.create(model=server.state.model_name, input=TEXTS, encoding_format="base64")
    # the SDK hands base64 through as the string; decode as OpenAI's format says: little-endian float32
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data])
    assert np.array_equal(decoded, got)
    wait_pool_empty(server)


def test_every_input_form(server, offline):
    ids = [offline.tokenizer.encode(t) for t in TEXTS]
    want = offline([{"prompt_token_ids": i} for i in ids])
    url = server.url + "/v1/embeddings"
    for body, rows in [
        ({"input": TEXTS[0]}, [0]),
        ({"input": TEXTS}, [0, 1, 2]),
        ({"input": ids[1]}, [1]),
        ({"input": ids}, [0, 1, 2]),
    ]:
        status, out = run(post(url, body))
        assert status == 200, out
        got = np.array([d["embedding"] for d in out["data"]], dtype=np.float32)
        assert np.abs(got - want[rows]).max() < SAME, body
        assert out["usage"] == {
            "prompt_tokens": sum(len(ids[r]) for r in rows),
            "total_tokens": sum(len(ids[r]) for r in rows),
            "completion_tokens": 0,
        }
    wait_pool_empty(server)


def test_many_inputs_are_prefilled_together(server, offline):
    """64 inputs of one request are queued together: a few steps, not one per input, and the same vectors."""
    texts = [f"item {i} of the list" for i in range(64)]
    before = stats(server)["num_steps"]
    status, out = run(post(server.url + "/v1/embeddings", {"input": texts}))
    assert status == 200, out
    assert stats(server)["num_steps"] - before <= 4
    got = np.array([d["embedding"] for d in out["data"]], dtype=np.float32)
    assert np.abs(got - offline(texts)).max() < SAME
    wait_pool_empty(server)


def test_score_and_rerank_are_cosine_similarities(server, offline):
    vec = dict(zip(TEXTS, offline(TEXTS)))
    status, out = run(post(server.url + "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}))
    assert status == 200, out
    assert out["score_method"] == "cosine_similarity" and out["object"] == "list"
    want = [float(vec[TEXTS[0]] @ vec[t]) for t in TEXTS[1:]]
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert np.allclose([d["score"] for d in out["data"]], want, atol=1e-5)
    status, pairwise = run(post(server.url + "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}))
    assert status == 200 and np.isclose(pairwise["data"][1]["score"], vec[TEXTS[1]] @ vec[TEXTS[2]], atol=1e-5)

    body = {"query": TEXTS[0], "documents": TEXTS[1:] + [TEXTS[0]], "top_n": 2}
    status, ranked = run(post(server.url + "/v1/rerank", body))
    assert status == 200, ranked
    assert ranked["score_method"] == "cosine_similarity"
    assert [r["index"] for r in ranked["results"]][0] == 2  # the query itself: cosine 1
    assert np.isclose(ranked["results"][0]["relevance_score"], 1, atol=1e-5)
    assert ranked["results"][0]["document"] == {"text": TEXTS[0]} and len(ranked["results"]) == 2
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert scores == sorted(scores, reverse=True)
    status, bare = run(post(server.url + "/v2/rerank", {**body, "return_documents": False, "top_n": None}))
    assert status == 200 and len(bare["results"]) == 3 and "document" not in bare["results"][0]
    wait_pool_empty(server)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": TEXTS[0], "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": TEXTS[0], "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": [TEXTS[0], "x " * (2 * MAX_MODEL_LEN)]}, "input"),
        ("/v1/embeddings", {"input": [10**7]}, "input"),
        ("/v1/embeddings", {"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": 5}, "input"),
        ("/v1/embeddings", {}, "input"),
        ("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": TEXTS}, "text_1"),
        ("/v1/rerank", {"query": "", "documents": TEXTS}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["x " * (2 * MAX_MODEL_LEN)]}, "documents"),
    ],
)
def test_bad_input_is_a_400_and_nothing_is_left(server, path, body, param):
    status, out = run(post(server.url + path, body))
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param, out
    wait_pool_empty(server)


def test_openai_sdk_raises_bad_request(server):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).embeddings.create(model=server.state.model_name, input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"


def test_the_pooler_config_option():
    from rawpaged.entrypoints.cli import build_serve_parser, engine_config_from_args
    from rawpaged.pooling_params import PoolerConfig

    parser = build_serve_parser()
    args = parser.parse_args(["--pooler-config", '{"pooling_type": "mean", "normalize": false}'])
    assert engine_config_from_args(args).pooler_config == PoolerConfig("MEAN", False)
    assert engine_config_from_args(parser.parse_args([])).pooler_config is None
    for bad in ('{"pooling_type": "MAX"}', '{"pool": "MEAN"}', "not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--pooler-config", bad])


def test_run_batch_embeddings_and_scores(tmp_path, tiny_dir, offline):
    """``rawpaged run-batch`` lines for ``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` go through these
    routes: the vectors ``LLM.embed`` gives, the refusal of ``dimensions`` in its own line."""
    import asyncio
    import json

    from rawpaged.engine.llm_engine import LLMEngine
    from rawpaged.entrypoints.api_server import create_app
    from rawpaged.entrypoints.openai.batch.run_batch import run_batch

    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    engine = LLMEngine(config)
    bodies = {
        "emb": ("/v1/embeddings", {"model": "tiny", "input": TEXTS}),
        "score": ("/v1/score", {"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS[1:]}),
        "rerank": ("/v1/rerank", {"model": "tiny", "query": TEXTS[0], "documents": TEXTS[1:]}),
        "bad": ("/v1/embeddings", {"model": "tiny", "input": "x", "dimensions": 4}),
    }
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": u, "body": b}) for k, (u, b) in bodies.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    app = create_app(config, engine=engine, served_model_name="tiny")
    asyncio.run(run_batch(app, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False))
    out = {d["custom_id"]: d for d in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    vectors = np.array([d["embedding"] for d in out["emb"]["response"]["body"]["data"]], dtype=np.float32)
    assert np.abs(vectors - offline(TEXTS)).max() < SAME
    assert out["score"]["response"]["body"]["score_method"] == "cosine_similarity"
    assert len(out["rerank"]["response"]["body"]["results"]) == 2
    assert out["bad"]["response"]["status_code"] == 400 and out["bad"]["error"]["param"] == "dimensions"
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
