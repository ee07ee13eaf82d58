"""vLLM's and OpenAI's sampling parameters through the server on the real default model: penalties,
logit_bias, min_tokens, bad_words and allowed_token_ids reach the engine from /v1/completions,
/v1/chat/completions and the websocket, and each changes the output as it should (the step-by-step
reference checks are ``tests/engine/test_logits_processors.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("openai")

import json

import aiohttp
import openai

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.app import create_app
from tests.entrypoints.server_thread import ServerThread, run, wait_pool_empty

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LIST = "Write the numbers from one to ten in words: one, two,"


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_seqs=16)
    srv = ServerThread(create_app(config)).start()
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def token_of(tokenizer):
    def token_of(text):
        ids = tokenizer.encode_without_special_tokens(text)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    return token_of


def _complete(client, **kw):
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL, prompt=LIST, temperature=0, **kw).choices[0]


def test_completions_parameters_change_the_output(server, client, token_of):
    plain = _complete(client)
    banana = token_of(" banana")
    assert _complete(client, max_tokens=4, extra_body={"logit_bias": {str(banana): 100}}).text == " banana" * 4
    assert _complete(client, max_tokens=4, extra_body={"allowed_token_ids": [banana]}).text == " banana" * 4
    for extra in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0, "presence_penalty": 2.0}):
        assert _complete(client, extra_body=extra).text != plain.text, extra
    assert _complete(client, frequency_penalty=2.0, presence_penalty=2.0).text != plain.text  # OpenAI's fields
    words = plain.text.replace(",", " ").split()
    banned = _complete(client, extra_body={"bad_words": words[:2]}).text
    assert all(w not in banned.replace(",", " ").split() for w in words[:2]), (words[:2], banned)
    wait_pool_empty(server)


def test_chat_min_tokens_bad_words_and_logit_bias(server, client, token_of):
    short = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=64)
    assert "Paris" in short.choices[0].message.content and short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    held = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=n + 8, extra_body={"min_tokens": n + 8}
    )
    assert held.usage.completion_tokens == n + 8 and held.choices[0].finish_reason == "length"
    no_paris = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in no_paris.choices[0].message.content
    biased = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=3, logit_bias={str(token_of(" banana")): 100}
    )
    assert biased.choices[0].message.content.count("banana") == 3
    wait_pool_empty(server)


def test_websocket_takes_the_parameters(server, token_of):
    banana = token_of(" banana")

    async def main(extra):
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json(
                    {"type": "generate", "id": "a", "prompt": LIST, "max_tokens": 3, "temperature": 0, **extra}
                )
                text = ""
                while True:
                    msg = json.loads((await ws.receive(timeout=60)).data)
                    assert msg["type"] != "error", msg
                    if msg["type"] == "delta":
                        text += msg.get("text", "")
                    if msg.get("finish_reason") or msg["type"] == "done":
                        return text

    assert run(main({"logit_bias": {str(banana): 100}})) == " banana" * 3
    assert run(main({"allowed_token_ids": [banana], "repetition_penalty": 1.5, "min_tokens": 3})) == " banana" * 3


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"logit_bias": {"x1": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 150}}, "logit_bias"),
        ({"logit_bias": {"100000000": 1}}, "logit_bias"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"min_tokens": 99, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(server, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=extra.pop("max_tokens", 4), extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
