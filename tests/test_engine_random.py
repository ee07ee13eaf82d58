"""Engine mechanics on a small random model (fast, no download): loader errors, Qwen2 biases, and a
hypothesis state machine mixing n > 1, beams, prefix hits, preemption and aborts that checks the
allocator's invariants after every step."""

import json
import struct

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rawpaged import LLM, SamplingParams
from rawpaged.loader import load_config, load_weights, read_safetensors
from rawpaged.random_model import write_random_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), num_layers=2, seed=1)


def _engine(path, **kw):
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(path), device="cpu", **kw)


def test_generate_on_random_model_and_qwen2(tmp_path, tiny_dir):
    out = _engine(tiny_dir).generate(["hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    qwen = write_random_model(tmp_path / "qwen", architecture="Qwen2ForCausalLM", tie_word_embeddings=False)
    llm = _engine(qwen)
    assert llm.engine.model.layers[0]["qkv_bias"] is not None
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_warmup_runs_requests_then_resets_counters(tiny_dir):
    llm = _engine(tiny_dir)
    eng = llm.engine
    assert eng.warmup() > 0
    st = eng.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"], "warm-up requests returned their blocks"
    assert (st["num_steps"], st["prompt_tokens_total"], st["generation_tokens_total"], st["prefix_cache_queries"],
            st["num_preemptions"], st["peak_used_blocks"]) == (0, 0, 0, 0, 0, 0)
    eng.allocator.check_invariants()
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and eng.stats()["generation_tokens_total"] == 4
    eng.add_request("x", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        eng.warmup()


def test_forks_count_against_max_num_seqs_and_request_counts(tiny_dir):
    eng = _engine(tiny_dir, max_num_seqs=3).engine
    eng.add_request({"prompt_token_ids": [5] * 20}, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8,
                                                                   ignore_eos=True))
    eng.add_request({"prompt_token_ids": [6] * 20}, SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()  # prefill of the first request only: its n = 3 forks will fill max_num_seqs
    eng.step()
    st = eng.stats()
    assert (st["num_running"], st["num_requests_running"]) == (3, 1)
    assert (st["num_waiting"], st["num_requests_waiting"]) == (1, 1)
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    assert st["num_requests_running"] == st["num_requests_waiting"] == 0


def _write_raw(path, header: dict, data: bytes, header_len=None):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_len if header_len is not None else len(h)) + h + data)


@pytest.mark.parametrize("case, match", [
    ("truncated", "truncated"), ("header_beyond", "beyond the file"), ("overlap", "overlap"),
    ("out_of_range", "outside the data"), ("bad_json", "not valid JSON"), ("size_mismatch", "bytes for shape"),
])
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
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((tiny_dir / f).read_bytes())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert (_engine(tmp_path).generate(["abc"], params)[0].outputs[0].token_ids
            == _engine(tiny_dir).generate(["abc"], params)[0].outputs[0].token_ids)


class EngineMachine(RuleBasedStateMachine):
    """Random requests (shared prefixes, n > 1, beams) and aborts on a small pool; invariants every step."""

    tiny_dir = None

    @initialize(num_blocks=st.integers(12, 40), block_size=st.sampled_from([4, 16]))
    def setup(self, num_blocks, block_size):
        self.llm = LLM(model=str(self.tiny_dir), device="cpu", num_kv_blocks=num_blocks, block_size=block_size,
                       max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
        self.eng = self.llm.engine
        self.ids = []

    @rule(prefix=st.sampled_from([0, 1, 2]), tail=st.integers(1, 20), kind=st.sampled_from(["n1", "n3", "beam"]),
          max_tokens=st.integers(1, 8))
    def add(self, prefix, tail, kind, max_tokens):
        tokens = [10 + i for i in range(prefix * 16)] + [100 + 7 * i + tail for i in range(tail)]
        params = {"n1": SamplingParams(temperature=0.7, seed=1, max_tokens=max_tokens, ignore_eos=True),
                  "n3": SamplingParams(n=3, temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
                  "beam": SamplingParams(beam_width=3, max_tokens=max_tokens, ignore_eos=True)}[kind]
        try:
            self.ids.append(self.eng.add_request({"prompt_token_ids": tokens}, params))
        except ValueError as e:
            assert "KV blocks" in str(e)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.eng.step()
            self._check()

    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.ids if r in self.eng.requests]
        if live:
            self.eng.abort_request(data.draw(st.sampled_from(live)))

    def _check(self):
        tables = [s.block_table for req in self.eng.requests.values() for s in req.seqs
                  if s.block_table is not None and not s.is_finished]
        self.eng.allocator.check_invariants(tables)

    @invariant()
    def invariants(self):
        if hasattr(self, "eng"):
            self._check()

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        for _ in range(500):
            if not self.eng.has_unfinished_requests():
                break
            self.eng.step()
        assert not self.eng.has_unfinished_requests(), "requests never finished (hang?)"
        s = self.llm.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"]
        assert all(b.ref_count == 0 for b in self.eng.allocator.blocks)


def test_engine_state_machine(tiny_dir):
    EngineMachine.tiny_dir = tiny_dir
    machine = EngineMachine.TestCase
    machine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
    machine().runTest()


def test_cuda_unavailable_is_one_clear_line():
    from rawpaged.kernels import get_backend

    try:
        get_backend("cuda")
    except RuntimeError as e:
        assert "\n" not in str(e) and "cuda" in str(e).lower()
    else:
        pytest.skip("a CUDA device is available here")
    with pytest.raises(ValueError, match="device"):
        get_backend("tpu")
