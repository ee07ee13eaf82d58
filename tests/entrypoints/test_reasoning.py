"""Reasoning models (``--reasoning-parser``): the parsers' split of ``<think>`` text, piece by piece as a
stream brings it and whole; then a tiny Qwen3 model with the real Qwen3 tokenizer and chat template whose
greedy output is scripted (``tests/scripted_model.py``), served with ``reasoning_parser="qwen3"``: the
thinking in ``reasoning`` / ``reasoning_content`` (message and stream deltas, and the websocket), none with
``enable_thinking: false``, and structured outputs that constrain only what follows ``</think>``."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("openai")

import numpy as np

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.generation.reasoning_parsers import ReasoningParser, reasoning_token_count, split_reasoning
from tests.entrypoints.server_thread import openai_client, run, served, wait_pool_empty, ws_generate
from tests.scripted_model import write_scripted_model
from tests.tokenizer_files import tokenizer_dir

CASES = [  # (parser, output, reasoning, content)
    ("qwen3", "<think>\nLet me think</think>\n\nParis", "\nLet me think", "\n\nParis"),
    ("qwen3", "Paris", None, "Paris"),
    ("qwen3", "  <think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("qwen3", "a <think>b</think>", None, "a <think>b</think>"),
    ("deepseek_r1", "thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", "<think>thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", "still thinking <", "still thinking <", ""),
    ("qwen3", "<think></think>", "", ""),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_split_whole_and_in_every_piece_size(name, text, reasoning, content):
    assert split_reasoning(name, text) == (reasoning, content)
    rng = np.random.default_rng(len(text))
    for _ in range(20):  # random cuts: tags split across pieces
        cuts = sorted(rng.choice(len(text) + 1, size=min(4, len(text)), replace=False).tolist())
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = ReasoningParser(name)
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert "".join(r for r, _ in got) == (reasoning or "") and "".join(c for _, c in got) == content


# ------------------------------------------------------------------------------------------ served
QWEN3_THINK, QWEN3_END, NL, NL2, EOS = 151667, 151668, 198, 271, 151645
LET, ME, THINK, PARIS = 10061, 752, 1744, 59604
#: after the generation prompt ("...assistant\n"): <think>Let me think</think>\n\nParis<|im_end|>; with
#: enable_thinking false the prompt ends in "</think>\n\n", so: Paris<|im_end|>
SCRIPT = {
    NL: QWEN3_THINK,
    QWEN3_THINK: LET,
    LET: ME,
    ME: THINK,
    THINK: QWEN3_END,
    QWEN3_END: NL2,
    NL2: PARIS,
    PARIS: EOS,
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_scripted_model(tmp_path_factory.mktemp("qwen3") / "m", tokenizer_dir("qwen3"), SCRIPT)
    config = EngineConfig(model=str(model), device="cpu", num_kv_blocks=64, max_model_len=256, reasoning_parser="qwen3")
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=60)


def test_reasoning_is_split_out_of_the_message_and_the_stream(server, client):
    out = client.chat.completions.create(model=server.state.model_name, messages=ASK, temperature=0, max_tokens=16)
    message = out.choices[0].message
    assert message.content == "\n\nParis" and out.choices[0].finish_reason == "stop"
    extra = message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == "Let me think"
    stream = client.chat.completions.create(
        model=server.state.model_name, messages=ASK, temperature=0, max_tokens=16, stream=True
    )
    reasoning, content, legacy = "", "", ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            legacy += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert (reasoning, legacy, content) == ("Let me think", "Let me think", "\n\nParis")
    wait_pool_empty(server)


def test_enable_thinking_false_parses_no_reasoning(server, client):
    out = client.chat.completions.create(
        model=server.state.model_name,
        messages=ASK,
        temperature=0,
        max_tokens=16,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = out.choices[0].message
    assert message.content == "Paris" and "reasoning" not in (message.model_extra or {})


def test_structured_outputs_apply_after_the_reasoning(server, client):
    """The choice constraint waits for </think> (else the output could not think at all); after it, the
    answer is one of the choices (the script's "\\n\\n" is not allowed there, a bias picks Paris)."""
    out = client.chat.completions.create(
        model=server.state.model_name,
        messages=ASK,
        temperature=0,
        max_tokens=16,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}, "logit_bias": {str(PARIS): 30}},
    )
    message = out.choices[0].message
    assert message.model_extra["reasoning"] == "Let me think" and message.content == "Paris"
    assert out.choices[0].finish_reason == "stop"


def test_websocket_carries_reasoning_deltas(server):
    text, last = run(ws_generate(server.url, {"id": "r", "messages": ASK, "max_tokens": 16, "temperature": 0}))
    assert text == "\n\nParis" and last["finish_reason"] == "stop"

    async def reasoning_of():
        import json

        import aiohttp

        async with aiohttp.ClientSession() as s, s.ws_connect(server.url + "/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": 1, "messages": ASK, "max_tokens": 16, "temperature": 0})
            reasoning = ""
            while True:
                msg = json.loads((await ws.receive(timeout=60)).data)
                if msg["type"] == "delta":
                    reasoning += msg.get("reasoning", "")
                if msg["type"] in ("done", "error"):
                    return reasoning

    assert run(reasoning_of()) == "Let me think"


def test_responses_api_returns_a_reasoning_item(server, client):
    """/v1/responses: the thinking as a reasoning item before the message, whole and streamed."""
    r = client.responses.create(model=server.state.model_name, input="What is the capital of France?", temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think" and r.output_text == "\n\nParis"
    with client.responses.stream(model=server.state.model_name, input="Capital of France?", temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Let me think" and final.output_text == "\n\nParis"


def test_responses_usage_counts_the_reasoning_tokens(server, client):
    """The script's output is <think> Let me think </think> \\n\\n Paris <|im_end|>: the five tokens up to
    </think> are reasoning, of eight."""
    out = client.responses.create(model=server.state.model_name, input=ASK[0]["content"], temperature=0)
    assert out.output_text == "\n\nParis"
    assert (out.usage.output_tokens_details.reasoning_tokens, out.usage.output_tokens) == (5, 8)
    events = list(
        client.responses.create(model=server.state.model_name, input=ASK[0]["content"], temperature=0, stream=True)
    )
    usage = events[-1].response.usage
    assert (usage.output_tokens_details.reasoning_tokens, usage.output_tokens) == (5, 8)


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("qwen3", "<think>ab</think>cd", 17),  # up to the token that completes </think>
        ("qwen3", "<think>cut off", 14),  # all reasoning
        ("qwen3", "no reasoning", 0),
        ("deepseek_r1", "ab</think>c", 10),
        (None, "<think>ab</think>cd", 0),  # no parser
    ],
)
def test_reasoning_token_count(name, text, expected):
    assert reasoning_token_count(name, _CharTokenizer(), [ord(c) for c in text]) == expected
