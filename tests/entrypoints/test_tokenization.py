"""vLLM's tokenizer routes, ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, on a small
random model behind an API key: ids against the ``tokenizers`` library's own encoding of the prompt (and
of the chat template's text, written out here), counts against what ``/v1/chat/completions`` reports as
the prompt's, the token strings against the vocabulary, 400 bodies naming the field, 401 without the key,
503 while the model loads. One test runs the default model's tokenizer: its chat template and what
lm-evaluation-harness' remote tokenizer reads."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import json
import shutil
import threading

import aiohttp
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from rawpaged.testing.random_model import write_random_model
from tests.entrypoints.server_thread import ServerThread, run, served

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
HI = [{"role": "user", "content": "hi"}]
ROUTES = (
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/tokenizer_info", None),
)


@pytest.fixture(scope="module")
def model(tiny_dir, tmp_path_factory):
    """The tiny model, its tokenizer's post-processor set to put ``<|endoftext|>`` (id 0) first, as Llama
    3's puts its BOS: what ``add_special_tokens`` adds."""
    d = tmp_path_factory.mktemp("bos") / "tiny"
    shutil.copytree(tiny_dir, d)
    tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def server(model):
    config = EngineConfig(model=str(model), device="cpu", num_kv_blocks=128, max_model_len=MAX_MODEL_LEN)
    with served(config, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf(model):
    """The model's tokenizer as the ``tokenizers`` library loads it: the reference."""
    return HFTokenizer.from_file(str(model / "tokenizer.json"))


async def _request(url: str, method: str, path: str, body=None, headers=AUTH, data=None) -> tuple:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body, data=data, headers=headers) as r:
            return r.status, await r.json()


def call(srv, method: str, path: str, body=None, headers=AUTH, data=None) -> tuple:
    """``(status, JSON body)`` of one request to ``srv``."""
    return run(_request(srv.url, method, path, body, headers, data))


def tokenize(srv, body: dict) -> dict:
    status, out = call(srv, "POST", "/tokenize", body)
    assert status == 200, out
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    return out


@pytest.mark.parametrize("text", ["hello world", "a <|im_start|>b<|im_end|>", "é😀 日本", ""])
@pytest.mark.parametrize("add_special_tokens", [True, False, None])
def test_tokenize_a_prompt_as_the_tokenizer_does(server, hf, text, add_special_tokens):
    body = {"prompt": text, "return_token_strs": True}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    out = tokenize(server, body)
    expected = hf.encode(text, add_special_tokens=add_special_tokens is not False).ids
    assert out["tokens"] == expected and (expected[:1] == [0]) == (add_special_tokens is not False)
    assert out["token_strs"] == [hf.id_to_token(i) for i in expected]
    if "<|im_start|>" in text:
        assert 1 in out["tokens"] and "<|im_start|>" in out["token_strs"]  # special-token text parsed, as vLLM
    if text == "hello world":
        assert out["token_strs"][-6] == "Ġ"  # the byte-level vocabulary's spelling of the space
    assert tokenize(server, {"prompt": text})["token_strs"] is None


def test_a_prompt_longer_than_the_context_is_counted(server, hf):
    """Not refused: ``count`` against ``max_model_len`` is for the client to weigh."""
    out = tokenize(server, {"prompt": "ab" * MAX_MODEL_LEN})
    assert out["count"] == 2 * MAX_MODEL_LEN + 1 and out["tokens"] == hf.encode("ab" * MAX_MODEL_LEN).ids


def test_tokenize_a_chat_renders_the_template(server, hf):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    out = tokenize(server, {"messages": messages, "return_token_strs": True})
    assert out["tokens"] == hf.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids
    assert out["token_strs"] == [hf.id_to_token(i) for i in out["tokens"]]
    no_prompt = tokenize(server, {"messages": messages, "add_generation_prompt": False})
    assert no_prompt["tokens"] == hf.encode(text, add_special_tokens=False).ids
    with_specials = tokenize(server, {"messages": messages, "add_special_tokens": True})
    assert with_specials["tokens"] == [0, *out["tokens"]]  # the post-processor's, on top of the template's
    prefill = [*messages, {"role": "assistant", "content": "Sure, "}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    cont = tokenize(server, body)
    assert cont["tokens"] == hf.encode(text + "<|im_start|>assistant\nSure, ", add_special_tokens=False).ids


def test_a_chat_s_contents_stay_text(server, hf):
    out = tokenize(server, {"messages": [{"role": "user", "content": "x<|im_end|>"}], "add_generation_prompt": False})
    literal = [hf.token_to_id(c) for c in "x<|im_end|>"]  # one byte token per character
    plain = [*hf.encode("user\n", add_special_tokens=False).ids, *literal, 2, hf.token_to_id("Ċ")]
    assert out["tokens"] == [1, *plain]


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f", "parameters": {}}}]])
def test_a_chat_s_count_is_the_prompt_chat_completions_runs(server, tools):
    body = {"messages": [{"role": "system", "content": "s"}, *HI]}
    if tools:
        body["tools"] = tools
    status, done = call(server, "POST", "/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200, done
    count = tokenize(server, body)["count"]
    assert count == done["usage"]["prompt_tokens"]
    if tools:  # this template has no tools variable: they are written into the system message
        assert count > tokenize(server, {"messages": body["messages"]})["count"] + 50


def test_detokenize_gives_the_text_back(server, hf):
    text = "<|endoftext|><|im_start|>user\nhé 😀<|im_end|>"  # special tokens written out
    ids = tokenize(server, {"prompt": text[13:]})["tokens"]
    status, out = call(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and out == {"prompt": text} and hf.decode(ids, skip_special_tokens=False) == text
    assert call(server, "POST", "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
    assert call(server, "POST", "/detokenize", {"tokens": [258], "model": server.state.model_name})[0] == 200


def test_tokenizer_info(server, model):
    status, info = call(server, "GET", "/tokenizer_info")
    assert status == 200
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert info["chat_template"] == config["chat_template"]
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        None,
        None,
    )
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["add_bos_token"] is False
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["added_tokens_decoder"] == {"0": "<|endoftext|>", "1": "<|im_start|>", "2": "<|im_end|>"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "a", "messages": HI}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/tokenize", {"prompt": None}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": HI, "add_generation_prompt": 0}, "add_generation_prompt"),
        ("/tokenize", {"messages": HI, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("/tokenize", {"messages": HI, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/tokenize", {"messages": HI, "tools": [{"type": "function"}]}, "tools"),
        ("/tokenize", [1], None),
        ("/detokenize", {"tokens": [1, 300]}, "tokens"),  # past the vocabulary (259 tokens)
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [1 << 40]}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": None}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    status, out = call(server, "POST", path, body)
    assert status == 400, out
    error = out["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error
    if body == {"tokens": [1, 300]}:
        assert "tokens[1] is 300" in error["message"]
    if body == {"prompt": 5}:
        assert error["message"] == "prompt must be a string, got 5"  # not the completions prompt's types


def test_invalid_json_and_an_unknown_model(server):
    for path in ("/tokenize", "/detokenize"):
        status, out = call(server, "POST", path, data=b"{nope", headers={**AUTH, "Content-Type": "application/json"})
        assert status == 400 and "not valid JSON" in out["error"]["message"]
    for path, body in (("/tokenize", {"prompt": "a", "model": "nope"}), ("/detokenize", {"tokens": [], "model": "x"})):
        status, out = call(server, "POST", path, body)
        assert status == 404 and out["error"]["code"] == "model_not_found"


def test_the_api_key_is_required(server):
    for method, path, body in ROUTES:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            status, out = call(server, method, path, body, headers=headers)
            assert status == 401 and out["error"]["type"] == "authentication_error", (path, headers)
        assert call(server, method, path, body)[0] == 200, path


def test_503_while_the_model_loads():
    release = threading.Event()

    def loader():
        release.wait(30)
        raise RuntimeError("no model here")

    srv = ServerThread(create_app(EngineConfig(model="/nonexistent/TinyModel"), loader=loader, api_key=KEY)).start()
    try:
        for method, path, body in ROUTES:
            status, out = call(srv, method, path, body)
            assert status == 503 and "loading" in out["error"]["message"], (path, out)
            assert call(srv, method, path, body, headers={})[0] == 401, path
    finally:
        release.set()
    srv._thread.join(30)
    assert srv.exit_code == 1


@pytest.mark.model
def test_default_model_tokenizer_chat_and_what_lm_eval_reads(model_dir, tmp_path):
    """The default model's tokenizer (on random weights of a small shape): a chat as its template writes
    it, and what lm-evaluation-harness' ``RemoteTokenizer`` reads (``eos_token``, ``bos_token``,
    ``pad_token``, ``chat_template`` from ``/tokenizer_info``; ``encode(eos_token)[0]`` with
    ``add_special_tokens`` false; ``/detokenize``'s ``prompt``)."""
    hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    d = write_random_model(tmp_path / "m", tokenizer_from=model_dir, seed=1)
    config = EngineConfig(model=str(d), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    srv = ServerThread(create_app(config, api_key=KEY)).start()
    try:
        srv.wait_healthy()
        text = (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        )
        chat = tokenize(srv, {"messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert chat["tokens"] == hf.encode(text, add_special_tokens=False).ids and chat["tokens"][:3] == [1, 9690, 198]
        words = tokenize(srv, {"prompt": "Hello world", "return_token_strs": True})
        assert words["token_strs"] == ["Hello", "Ġworld"] and words["tokens"] == hf.encode("Hello world").ids
        status, info = call(srv, "GET", "/tokenizer_info")
        assert status == 200
        assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
        assert info["model_max_length"] == MAX_MODEL_LEN and info["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert "SmolLM" in info["chat_template"] and info["added_tokens_decoder"]["2"] == "<|im_end|>"
        for special, token_id in ((info["eos_token"], 2), (info["bos_token"], 1)):
            assert tokenize(srv, {"prompt": special, "add_special_tokens": False})["tokens"] == [token_id]
        assert call(srv, "POST", "/detokenize", {"tokens": chat["tokens"]}) == (200, {"prompt": text})
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize(
    "options",
    [{"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}],
)
def test_chat_honours_the_template_options_as_tokenize_does(server, options):
    body = {"messages": [*HI, {"role": "assistant", "content": "Sure, "}], **options}
    status, done = call(server, "POST", "/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200, done
    assert done["usage"]["prompt_tokens"] == tokenize(server, body)["count"]


def test_chat_refuses_continue_final_message_with_add_generation_prompt(server):
    body = {"messages": HI, "continue_final_message": True, "max_tokens": 1}
    status, out = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "continue_final_message"
