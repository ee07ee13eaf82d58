"""Loading a model directory: malformed safetensors files, missing/unexpected/misshapen tensors, bad
config.json, and sharded checkpoints (on small random models, no download)."""

import json
import struct

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.model_executor.model_loader import load_config, load_weights, read_safetensors
from tests.conftest import tiny_engine as _engine


def _write_raw(path, header: dict, data: bytes, header_len=None):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_len if header_len is not None else len(h)) + h + data)


@pytest.mark.parametrize(
    "case, match",
    [
        ("truncated", "truncated"),
        ("header_beyond", "beyond the file"),
        ("overlap", "overlap"),
        ("out_of_range", "outside the data"),
        ("bad_json", "not valid JSON"),
        ("size_mismatch", "bytes for shape"),
    ],
)
def test_bad_safetensors_files(tmp_path, case, match):
    f = tmp_path / "model.safetensors"
    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if case == "truncated":
        f.write_bytes(b"\x01\x00")
    elif case == "header_beyond":
        _write_raw(f, {"a": a}, b"\0" * 8, header_len=10_000)
    elif case == "overlap":
        _write_raw(f, {"a": a, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    elif case == "out_of_range":
        _write_raw(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    elif case == "bad_json":
        f.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    elif case == "size_mismatch":
        _write_raw(f, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match=match) as e:
        read_safetensors(f)
    assert str(f) in str(e.value)


def test_missing_unexpected_and_misshapen_tensors(tmp_path, tiny_dir):
    from safetensors.numpy import load_file, save_file

    cfg = load_config(tiny_dir)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    for name, mutate, match in [
        ("missing", lambda t: t.pop("model.norm.weight"), "missing tensors"),
        ("unexpected", lambda t: t.__setitem__("model.extra.weight", np.zeros(2, np.float32)), "unexpected"),
        ("shape", lambda t: t.__setitem__("model.norm.weight", np.ones(5, np.float32)), "model.norm.weight"),
    ]:
        d = tmp_path / name
        d.mkdir()
        t = dict(tensors)
        mutate(t)
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            load_weights(d, cfg)


def test_bad_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 3}))
    with pytest.raises(ValueError, match="missing field"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match="neither"):
        LLM(model=str(tmp_path / "nope"), device="cpu")


def test_sharded_checkpoint_loads(tmp_path, tiny_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, ns in shards.items() for n in ns}})
    )
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((tiny_dir / f).read_bytes())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert (
        _engine(tmp_path).generate(["abc"], params)[0].outputs[0].token_ids
        == _engine(tiny_dir).generate(["abc"], params)[0].outputs[0].token_ids
    )


def _copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_generation_config_defaults_and_eos_ids(tmp_path, tiny_dir):
    """generation_config.json: its eos list joins config.json's, its sampling fields become the defaults
    (``LLM`` with no params, and the server where a request leaves them unset), an explicit value wins,
    and what the engine does not apply is named."""
    from rawpaged.entrypoints.openai.completion.protocol import CompletionRequest

    d = _copy_model(tiny_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [2, 5],
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 64,
            }
        )
    )
    llm = _engine(d)
    assert llm.engine.eos_token_ids == {2, 5}
    assert llm.engine.generation_config.ignored == ("max_new_tokens",)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 20, 0.0, 1.05)
    defaults = llm.engine.default_sampling_params
    unset = CompletionRequest(prompt="x").sampling_params(4, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    explicit = CompletionRequest(prompt="x", temperature=0, top_p=1.0, repetition_penalty=1.0).sampling_params(
        4, defaults
    )
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.repetition_penalty) == (0.0, 1.0, 20, 1.0)
    assert CompletionRequest(prompt="x").sampling_params(4).temperature == 1.0, "no generation config: 1.0"

    (d / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        _engine(d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sharded_checkpoint_matches_reference(tmp_path, dtype):
    """A Qwen3 checkpoint stored in bf16/fp16 over three shards runs (in float32 on the CPU) to the greedy
    ids of the float64 reference on the same rounded weights."""
    from tests.model_reference import MAX_MODEL_LEN, PROMPTS, ROPES, decisive_prefix, greedy_reference, write_checkpoint

    cfg, w = write_checkpoint(tmp_path / "m", "qwen3", ROPES["yarn"], dtype=dtype, num_shards=3, seed=3)
    assert len(list((tmp_path / "m").glob("model-0000?-of-00003.safetensors"))) == 3
    llm = LLM(model=str(tmp_path / "m"), device="cpu", num_kv_blocks=64, block_size=4)
    assert llm.engine.max_model_len == MAX_MODEL_LEN
    prompt = PROMPTS[3]
    ids, margins = greedy_reference(cfg, w, prompt, 8, MAX_MODEL_LEN)
    k = decisive_prefix(ids, margins)
    assert k >= 6
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids)[:k] == ids[:k]


def test_context_and_template_kwargs_are_checked_up_front(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's context of 2048"):
        _engine(tiny_dir, max_model_len=100000)
    llm = _engine(tiny_dir)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat_template_kwargs may not set \\['messages'\\]"):
        llm.chat(hi, chat_template_kwargs={"messages": 1})
    with pytest.raises(ValueError, match="must be a mapping"):
        llm.chat(hi, chat_template_kwargs=["x"])
    assert llm.engine.kv_cache_manager.block_pool.num_free_blocks == 64
