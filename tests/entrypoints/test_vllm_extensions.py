"""vLLM's extensions of chat and completions, as vLLM's own API tests use them: chat ``echo`` (the response
role's last message continued), ``stream_options.continuous_usage_stats``, ``return_token_ids`` and
``return_tokens_as_token_ids``, ``max_tokens`` bounded by the context alone, and ``-1`` logprobs (the whole
vocabulary, within ``--max-logprobs``). On the tiny random model (vocabulary 259, byte-level tokenizer)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import re

import aiohttp

from rawpaged import LLM, SamplingParams
from rawpaged.config import EngineConfig
from rawpaged.errors import InvalidRequestError
from rawpaged.testing.random_model import write_random_model
from tests.entrypoints.server_thread import run, served, sse

VOCAB = 259
MAX_MODEL_LEN = 6000  # above the old 4096 cap on max_tokens
PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "Say something."}]
PREFILL = [*ASK, {"role": "assistant", "content": "Well, I"}]
#: every token id stops generation: a request ends after its first token, whatever it may ask for
STOP_AT_ONCE = list(range(VOCAB))


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("long"), num_layers=2, seed=1, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(long_dir):
    config = EngineConfig(model=str(long_dir), device="cpu", num_kv_blocks=400, max_model_len=MAX_MODEL_LEN)
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def all_logprobs_server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256, max_logprobs=-1)
    with served(config) as srv:
        yield srv


async def _post(url, body):
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def _sse(url, body):
    async with aiohttp.ClientSession() as s:
        return (await sse(s, url, body))[0]


def post(server, path, body):
    return run(_post(server.url + path, body))


def stream(server, path, body):
    return run(_sse(server.url + path, {**body, "stream": True}))


def completion(server, **kw):
    return {"model": server.state.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}


def chat(server, **kw):
    return {"model": server.state.model_name, "messages": ASK, "max_tokens": 6, "temperature": 0, **kw}


def tokenize(server, body) -> list:
    status, out = post(server, "/tokenize", body)
    assert status == 200, out
    return out["tokens"]


def streamed_content(chunks) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


# ------------------------------------------------------------------------------------------ chat echo
def test_chat_echo_continues_the_last_message_of_the_response_role(server):
    body = chat(server, messages=PREFILL, add_generation_prompt=False, continue_final_message=True)
    status, plain = post(server, "/v1/chat/completions", body)
    status2, echoed = post(server, "/v1/chat/completions", {**body, "echo": True})
    assert status == status2 == 200
    generated = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"] == {**plain["choices"][0]["message"], "content": "Well, I" + generated}
    assert echoed["usage"] == plain["usage"]  # the echoed text is prompt, not completion
    chunks = stream(server, "/v1/chat/completions", {**body, "echo": True, "n": 2})
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[1]["delta"] == {"content": "Well, I"}  # its own chunk, before any token
        assert "".join(c["delta"].get("content") or "" for c in mine) == "Well, I" + generated


def test_chat_echo_needs_the_last_message_in_the_response_role(server):
    _, plain = post(server, "/v1/chat/completions", chat(server))
    _, echoed = post(server, "/v1/chat/completions", chat(server, echo=True))
    assert echoed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]  # user last
    assert (
        streamed_content(stream(server, "/v1/chat/completions", chat(server, echo=True)))
        == (plain["choices"][0]["message"]["content"])
    )
    # no generation prompt: the answer continues the user's message, in its role (vLLM's response role)
    body = chat(server, add_generation_prompt=False, echo=True)
    _, user = post(server, "/v1/chat/completions", body)
    message = user["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Say something.")
    chunks = stream(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "user"
    assert streamed_content(chunks) == message["content"]


# ------------------------------------------------------------------------------------------ usage
def test_continuous_usage_stats_give_every_chunk_the_running_counts(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = completion(server, n=2, temperature=1.0, seed=3, stream_options=options, return_token_ids=True)
    chunks = stream(server, "/v1/completions", body)
    prompt_tokens = len(tokenize(server, {"prompt": PROMPT}))
    sent = [0, 0]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        sent[choice["index"]] += len(choice["token_ids"])
        u = c["usage"]
        assert u == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sent[choice["index"]],
            "total_tokens": prompt_tokens + sent[choice["index"]],
        }
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == sum(sent) > 2

    chat_chunks = stream(server, "/v1/chat/completions", chat(server, stream_options=options))
    chat_prompt = chat_chunks[-1]["usage"]["prompt_tokens"]
    assert chat_chunks[0]["usage"] == {
        "prompt_tokens": chat_prompt,
        "completion_tokens": 0,
        "total_tokens": chat_prompt,
    }
    counts = [c["usage"]["completion_tokens"] for c in chat_chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == chat_chunks[-1]["usage"]["completion_tokens"] > 1
    assert all(c["usage"]["total_tokens"] == chat_prompt + c["usage"]["completion_tokens"] for c in chat_chunks)


def test_continuous_usage_stats_count_only_with_include_usage(server):
    chunks = stream(server, "/v1/completions", completion(server, stream_options={"continuous_usage_stats": True}))
    assert chunks and all("usage" not in c for c in chunks)  # as vLLM: include_usage turns usage on


# ------------------------------------------------------------------------------------------ token ids
def test_return_token_ids_in_completions(server):
    status, out = post(server, "/v1/completions", completion(server, return_token_ids=True))
    assert status == 200
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(server, {"prompt": PROMPT})
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 6
    _, text = post(server, "/detokenize", {"tokens": choice["token_ids"]})
    assert text["prompt"] == choice["text"]
    chunks = stream(server, "/v1/completions", completion(server, return_token_ids=True))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    _, plain = post(server, "/v1/completions", completion(server))
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_return_token_ids_in_chat(server):
    status, out = post(server, "/v1/chat/completions", chat(server, return_token_ids=True))
    assert status == 200
    assert out["prompt_token_ids"] == tokenize(server, {"messages": ASK})
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == out["usage"]["completion_tokens"] == 6
    chunks = stream(server, "/v1/chat/completions", chat(server, return_token_ids=True))
    assert chunks[0]["prompt_token_ids"] == out["prompt_token_ids"] and chunks[0]["choices"][0]["delta"]["role"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks[1:]), []) == ids


def test_return_tokens_as_token_ids_names_every_logprobs_token_by_its_id(server):
    body = completion(server, logprobs=2, echo=True, return_token_ids=True, return_tokens_as_token_ids=True)
    _, out = post(server, "/v1/completions", body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    ids = choice["prompt_token_ids"] + choice["token_ids"]  # the echoed prompt's tokens first
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["top_logprobs"][0] is None
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
        assert token in top and all(re.fullmatch(r"token_id:\d+", k) for k in top) and 2 <= len(top) <= 3

    _, out = post(
        server,
        "/v1/chat/completions",
        chat(server, logprobs=True, top_logprobs=3, return_token_ids=True, return_tokens_as_token_ids=True),
    )
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in out["choices"][0]["token_ids"]]
    assert all(
        len(c["top_logprobs"]) == 3 and all(re.fullmatch(r"token_id:\d+", t["token"]) for t in c["top_logprobs"])
        for c in content
    )


# ------------------------------------------------------------------------------------------ limits
def test_max_tokens_is_bounded_by_the_context_only(server):
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat(server, stop_token_ids=STOP_AT_ONCE, **{field: 5000})
        body.pop("max_tokens") if field != "max_tokens" else None
        status, out = post(server, "/v1/chat/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] == 1, out
    status, out = post(server, "/v1/completions", completion(server, max_tokens=5000, stop_token_ids=STOP_AT_ONCE))
    assert status == 200, out
    prompt_tokens = out["usage"]["prompt_tokens"]
    room = MAX_MODEL_LEN - prompt_tokens
    status, out = post(server, "/v1/completions", completion(server, max_tokens=room, stop_token_ids=STOP_AT_ONCE))
    assert status == 200, out
    status, out = post(server, "/v1/completions", completion(server, max_tokens=room + 1))
    assert status == 400 and out["error"]["param"] == "max_tokens"
    assert out["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}. This model's maximum context length "
        f"is {MAX_MODEL_LEN} tokens and your request has {prompt_tokens} input tokens ({room + 1} > "
        f"{MAX_MODEL_LEN} - {prompt_tokens})."
    )
    body = chat(server, max_completion_tokens=MAX_MODEL_LEN)
    status, out = post(server, "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "max_completion_tokens"


@pytest.mark.parametrize(
    "path, body, param, what",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs", "sample"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", "sample"),
        ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "sample"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs", "prompt"),
        ("/v1/chat/completions", {"messages": ASK, "prompt_logprobs": -1}, "prompt_logprobs", "prompt"),
    ],
)
def test_logprobs_beyond_max_logprobs_are_refused_in_vllms_words(server, path, body, param, what):
    status, out = post(server, path, {"model": server.state.model_name, "max_tokens": 2, **body})
    n = VOCAB if -1 in body.values() else 21
    assert status == 400 and out["error"]["param"] == param
    assert out["error"]["message"] == f"Requested {what} logprobs of {n}, which is greater than max allowed: 20"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -2}, "logprobs"),
        ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -2}, "prompt_logprobs"),
    ],
)
def test_logprobs_below_minus_one_are_refused(server, path, body, param):
    status, out = post(server, path, {"model": server.state.model_name, "max_tokens": 2, **body})
    assert status == 400 and out["error"]["param"] == param


def test_minus_one_logprobs_are_the_whole_vocabulary(all_logprobs_server):
    srv = all_logprobs_server
    body = completion(srv, max_tokens=3, logprobs=-1, prompt_logprobs=-1, return_tokens_as_token_ids=True)
    status, out = post(srv, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    for top in choice["logprobs"]["top_logprobs"]:
        assert len(top) == VOCAB
        assert sum(2.718281828459045**v for v in top.values()) == pytest.approx(1.0, rel=1e-4)
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and all(len(entry) == VOCAB for entry in prompt[1:])
    ranks = sorted(v["rank"] for v in prompt[1].values())
    assert ranks[0] == 1 and ranks[-1] <= VOCAB

    status, out = post(srv, "/v1/chat/completions", chat(srv, max_tokens=2, logprobs=True, top_logprobs=-1))
    assert status == 200, out
    for token in out["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in token["top_logprobs"]]
        assert len(values) == VOCAB and values == sorted(values, reverse=True) and values[0] >= token["logprob"]
    status, out = post(srv, "/v1/completions", completion(srv, logprobs=VOCAB + 1))
    assert status == 400 and out["error"]["message"].endswith(f"greater than max allowed: {VOCAB}")


def test_the_engine_bounds_logprobs_by_max_logprobs(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64, max_logprobs=3)
    try:
        (out,) = llm.generate(["ab"], SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=3))
        assert all(len(entry) >= 3 for entry in out.outputs[0].logprobs)
        for kw, param in ((dict(logprobs=4), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs")):
            with pytest.raises(InvalidRequestError) as e:
                llm.generate(["ab"], SamplingParams(max_tokens=2, **kw))
            assert e.value.param == param and "greater than max allowed: 3" in str(e.value)
    finally:
        llm.close()
