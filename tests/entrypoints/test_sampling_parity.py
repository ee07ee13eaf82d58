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
from tests.entrypoints.server_thread import openai_client, run, served, wait_pool_empty, ws_generate

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LIST = "Write the numbers from one to ten in words: one, two,"


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_seqs=16)
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=120)


@pytest.fixture(scope="module")
def token_of(tokenizer):
    def token_of(text):
        ids = tokenizer.encode(text, add_special_tokens=False)
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

    def generate(extra):
        return run(ws_generate(server.url, {"id": "a", "prompt": LIST, "max_tokens": 3, "temperature": 0, **extra}))[0]

    assert generate({"logit_bias": {str(banana): 100}}) == " banana" * 3
    assert generate({"allowed_token_ids": [banana], "repetition_penalty": 1.5, "min_tokens": 3}) == " banana" * 3
    assert generate({"bad_words": ["four"], "frequency_penalty": 1.0, "presence_penalty": 0.5}) != ""


def test_websocket_prompt_logprobs_come_with_the_first_delta(server, engine_prompt_logprobs):
    ids, want = engine_prompt_logprobs

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json({"type": "generate", "id": 1, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 1})
                msgs = []
                while not msgs or msgs[-1]["type"] not in ("done", "error"):
                    msgs.append(json.loads((await ws.receive(timeout=60)).data))
                return msgs

    msgs = run(main())
    deltas = [m for m in msgs if m["type"] == "delta"]
    got = deltas[0]["prompt_logprobs"]
    assert all("prompt_logprobs" not in m for m in deltas[1:]) and got[0] is None and len(got) == len(ids)
    assert all(abs(got[i][str(ids[i])]["logprob"] - want[i][ids[i]].logprob) < 1e-4 for i in range(1, len(ids)))


def test_min_tokens_against_the_default_max_tokens(server, client):
    """Without max_tokens, min_tokens is checked against the default the server picks (16 for completions,
    what fits for chat), not refused up front."""
    out = client.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body={"min_tokens": 5})
    assert out.usage.completion_tokens >= 5
    chat = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, extra_body={"min_tokens": 30})
    assert chat.usage.completion_tokens >= 30
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"min_tokens": 20})  # the default is 16
    assert e.value.body["param"] == "min_tokens"


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


# ------------------------------------------------------------------------------------------ prompt logprobs
SCORED = "The capital of France is Paris."


@pytest.fixture(scope="module")
def engine_prompt_logprobs(model_dir, tokenizer):
    """The engine's own prompt logprobs of SCORED (``LLM``-level, checked against the float64 reference in
    tests/engine/test_prompt_logprobs.py)."""
    from rawpaged import LLM, SamplingParams

    ids = tokenizer.encode(SCORED)
    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64, max_model_len=1024)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    return ids, out[0].prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt(server, client, tokenizer, engine_prompt_logprobs):
    """lm-eval's loglikelihood request (token-id prompt, max_tokens 1, logprobs 1, echo): the prompt's tokens
    and logprobs come first, the first one null, top_logprobs for each other, text offsets running through
    the prompt's token texts; then the generated token."""
    ids, want = engine_prompt_logprobs
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.tokens[: len(ids)] == texts and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i][ids[i]].logprob) < 1e-4
        assert texts[i] in lp.top_logprobs[i] and 1 <= len(lp.top_logprobs[i]) <= 2
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    assert out.choices[0].text.startswith(SCORED) and out.usage.completion_tokens == 1


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server, client, engine_prompt_logprobs):
    ids, want = engine_prompt_logprobs
    out = client.completions.create(model=MODEL, prompt=SCORED, max_tokens=0, logprobs=0, echo=True)
    choice = out.choices[0]
    assert choice.text == SCORED and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [want[i][ids[i]].logprob for i in range(1, len(ids))], abs=1e-4
    )
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    streamed = list(
        client.completions.create(model=MODEL, prompt=SCORED, max_tokens=0, logprobs=0, echo=True, stream=True)
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text == SCORED and len(tokens) == len(ids)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=SCORED, max_tokens=0)


def test_prompt_logprobs_on_both_endpoints(server, client, tokenizer, engine_prompt_logprobs):
    """vLLM's prompt_logprobs: per choice on completions, top-level on chat; {id: {logprob, rank,
    decoded_token}}; refused with stream."""
    ids, want = engine_prompt_logprobs
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert abs(entry["logprob"] - want[i][ids[i]].logprob) < 1e-4 and entry["rank"] == want[i][ids[i]].rank
        assert entry["decoded_token"] == tokenizer.decode([ids[i]], skip_special_tokens=False)
        assert 2 <= len(got[i]) <= 3
    chat = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, extra_body={"prompt_logprobs": 0})
    lps = chat.model_extra["prompt_logprobs"]
    assert lps[0] is None and all(len(e) == 1 for e in lps[1:]) and len(lps) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    wait_pool_empty(server)
